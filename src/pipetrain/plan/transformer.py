"""A decoder-only language model priced from its `config.json` alone: sizes, parameters, FLOPs, block costs.

`load_sizes(PATH)` reads a model folder's `config.json` (or a bare one) as JSON: no `transformers` model is built,
no weight is read, no torch is imported. `DecoderSizes` is the description (layers, hidden, intermediate, query and
key/value heads, head dimension, vocabulary, tied head, gated MLP, biases, q/k norms, learned positions), read for
each family from its own field names (transformers 5.24's configuration classes): llama, qwen2, qwen3, mistral,
gemma, phi3, olmo2 (`hidden_size`, `num_hidden_layers`, ...) and gpt2 (`n_embd`, `n_layer`, `n_head`, `n_inner`).
Fused projections (Phi-3's `qkv_proj`, `gate_up_proj`) change no count.

Per token of a sequence of s (h hidden, q = heads × head_dim query width, k = kv_heads × head_dim, f intermediate):

- forward FLOPs of a layer: 2h(q + 2k) (Q, K, V) + 2qh (output) + 4sq (scores and weighted values, full causal
  square as the PaLM convention counts it) + 2hf·(3 gated | 2 plain); the head 2hV. Training FLOPs per token are
  `flops_per_token`: 6N + 12·L·q·s, the convention of `pipetrain.logs.mfu` (N without embedding tables, the head
  counted even when tied), so a plan's MFU and a run's are the same arithmetic.
- activations a layer keeps for backward (attention by SDPA/flash kernels: no s² tensor; Korthikanti et al. 2022's
  count generalised to grouped-query attention and gated MLPs), bytes per token at element size e: e·(4h (two norm
  inputs, the attention and MLP inputs) + 2q + 2k (Q, K, V, attention output) + 4f gated (gate, its activation,
  up, their product) | 2f plain) + q/k norm inputs e·(q + k) where the family has them + one byte per element of
  each dropout mask (GPT-2's two residual dropouts, when the config's rate is above 0); an RMSNorm family adds 2h,
  the two norms' normalised tensors (`weight * hidden` saves `hidden`, in transformers' eager RMSNorm, which
  pipetrain's adapter runs; LayerNorm's kernel saves its mean and rstd only) and, with q/k norms, e·(q + k) more.
  Checked with saved-tensor hooks on an eager `llama-cpu` layer (`benchmarks/memory_terms.py`): it saves the input,
  both norms' inputs, normalised tensors and outputs, Q, K, V, the attention output and the MLP's four f-wide
  tensors; rotary saves only cos and sin, not the q and k it rotates. Tensor parallelism
  (Megatron's split, `TensorSplit`) divides everything but the h parts and the masks, sequence parallelism that too.
- the head keeps the final norm's and the projection's inputs (2eh); its output, fp32 logits (4V per token:
  pipetrain casts a stage's outputs to fp32), is kept by the schedule to the step's end, and the loss keeps their
  log-probabilities in fp32 (4V per token, `loss_bytes`): both counted by plan/loss.py.

Mixtures of experts (qwen3_moe, qwen2_moe, mixtral, olmoe, gpt_oss): a MoE layer's MLP is a router (h·E), E routed
experts of width f_e (each as a gated MLP) of which each token uses top-k, and, for Qwen2-MoE, an always-on shared
expert with its gate. Its parameters count all experts; its FLOPs the active ones (router, top-k experts, shared
expert), and so do the `flops_params` of 6N (the convention for MoE throughput); it keeps for backward the top-k
experts' activations of each token (4·f_e gated, plus the dispatched input and output, 2h), the router's fp32
logits and, beyond a dense layer's count, what its RMS norms keep besides their inputs (`norm_products`: the
normalized product their weights' gradients need, 2h, and q + k with q/k norms). The routed experts are the block's `ExpertSplit` (plan/experts.py: what `ep` divides and moves). DeepSeek-V3's
multi-head latent attention is not priced yet.

`blocks` turns this into the planner's `BlockCost`s, one per block of pipetrain's Hugging Face adapter: the
embedding, one per decoder layer, the head (final norm and LM head). Parameters are counted in fp32 (`param_bytes`:
pipetrain keeps fp32 weights and optimizer state; bf16 gathers and Float8 are `predict`'s precision). The
embedding and the head stay whole on every tensor-parallel rank, as pipetrain runs them by default;
`vocab_parallel=True` splits them over the vocabulary, as train's `--loss-parallel` runs them (torchtitan's row-wise
embedding and loss-parallel head).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipetrain.errors import ConfigError
from pipetrain.plan.config_names import CONFIG_NAMES, FAMILY_FIELDS, ConfigNames
from pipetrain.plan.loss import log_softmax_bytes
from pipetrain.plan.model import BlockCost, ContextSplit, ExpertSplit, TensorSplit

__all__ = ["DecoderSizes", "ConfigNames", "CONFIG_NAMES", "FAMILY_FIELDS", "sizes_from_config", "load_sizes", "read_config"]

@dataclass(frozen=True, kw_only=True)
class DecoderSizes:
    """What the planner needs of a decoder-only LM (see the module docstring)."""

    model_type: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    gated: bool = True  #: gate, up and down projections (SwiGLU, GeGLU); False: two (GPT-2's c_fc, c_proj)
    fused_qkv: bool = False  #: q, k and v one matrix product (GPT-2's c_attn, Phi-3's qkv_proj)
    fused_gate_up: bool = False  #: gate and up one matrix product (Phi-3's gate_up_proj)
    layer_norm: bool = False  #: LayerNorm (weight and bias) rather than RMSNorm (weight)
    qkv_bias: bool = False
    o_bias: bool = False  #: the attention output projection's bias (row-parallel: replicated)
    mlp_bias: bool = False  #: the MLP's biases: up (and gate), column-parallel; down, row-parallel
    qk_norm: int = 0  #: q/k norm widths per layer (Qwen3: 2 × head_dim; OLMo-2: (heads + kv_heads) × head_dim)
    positions: int = 0  #: rows of a learned position embedding (GPT-2's n_positions); 0: rotary
    dropout: bool = False  #: residual dropout in training (its masks are kept for backward)
    # -- a mixture of experts (experts = 0: dense) --
    experts: int = 0  #: routed experts per MoE layer
    top_k: int = 0  #: the experts each token goes to
    expert_intermediate: int = 0  #: one routed expert's MLP width
    shared_intermediate: int = 0  #: the always-on shared expert's width (0: none)
    shared_gate: bool = False  #: the shared expert's sigmoid gate (a Linear(hidden, 1))
    expert_bias: bool = False  #: the experts' projections and the router have biases
    sparse: tuple[bool, ...] = ()  #: per layer, whether it is a MoE layer (empty: none is)
    sinks: bool = False  #: a learned sink logit per attention head (GPT-OSS)

    def is_moe(self, index: int) -> bool:
        """Whether layer `index` is a mixture-of-experts layer."""
        return bool(self.sparse) and self.sparse[index]

    def routed_params(self) -> int:
        """The routed experts of one MoE layer (what expert parallelism divides)."""
        f = self.expert_intermediate
        return self.experts * (self.hidden * f * (3 if self.gated else 2)
                               + ((2 * f + self.hidden) if self.expert_bias else 0))

    def _moe_shared(self) -> int:
        """A MoE layer's MLP parameters besides the routed experts: router, shared expert and its gate."""
        router = self.hidden * self.experts + (self.experts if self.expert_bias else 0)
        return router + 3 * self.hidden * self.shared_intermediate + (self.hidden if self.shared_gate else 0)

    def active_layer_params(self, index: int) -> int:
        """The parameters one token's forward uses in layer `index` (a MoE layer: top-k of its experts)."""
        if not self.is_moe(index):
            return self.layer_params()
        return self.moe_layer_params() - self.routed_params() + self.routed_params() * self.top_k // self.experts

    def moe_layer_params(self) -> int:
        """Parameters of one MoE layer (all its experts)."""
        dense_mlp = self.hidden * self.intermediate * (3 if self.gated else 2)
        mlp_biases = (self.intermediate * (2 if self.gated else 1) + self.hidden) * self.mlp_bias
        return self.layer_params() - dense_mlp - mlp_biases + self._moe_shared() + self.routed_params()

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def _norm(self) -> int:
        return self.hidden * (2 if self.layer_norm else 1)

    def matmul_params(self) -> int:
        """A layer's projection weights (what tensor parallelism splits and Float8 converts)."""
        h, q, k, f = self.hidden, self.q_width, self.kv_width, self.intermediate
        return h * (q + 2 * k) + q * h + h * f * (3 if self.gated else 2)

    def column_biases(self) -> int:
        up = self.intermediate * (2 if self.gated else 1)
        return (self.q_width + 2 * self.kv_width) * self.qkv_bias + up * self.mlp_bias

    def layer_params(self) -> int:
        """Parameters of one decoder layer."""
        return (self.matmul_params() + self.column_biases() + self.hidden * (self.o_bias + self.mlp_bias)
                + 2 * self._norm() + self.qk_norm + (self.heads if self.sinks else 0))

    def embedding_params(self) -> int:
        """The token embedding, plus the learned positions where the family has them."""
        return (self.vocab + self.positions) * self.hidden

    def head_params(self) -> int:
        """The final norm and the LM head's matrix (a copy of the embedding's when tied)."""
        return self._norm() + self.vocab * self.hidden

    def all_layer_params(self) -> int:
        """The decoder layers' parameters (MoE layers with all their experts)."""
        return sum(self.moe_layer_params() if self.is_moe(i) else self.layer_params() for i in range(self.layers))

    def params(self) -> int:
        """The model's parameters, a tied head counted once (as `model.num_parameters()` counts them)."""
        return (self.embedding_params() + self.all_layer_params() + self._norm()
                + (0 if self.tied else self.vocab * self.hidden))

    def flops_params(self) -> int:
        """N of the PaLM formula (`pipetrain.logs.mfu`): every parameter but the embedding tables, the head's
        matrix counted even when tied; of a MoE layer, the active ones (router, top-k experts, shared expert)."""
        return sum(self.active_layer_params(i) for i in range(self.layers)) + self.head_params()

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward, no recomputation) of one token: 6N + 12·L·heads·head_dim·s."""
        return 6.0 * self.flops_params() + 12.0 * self.layers * self.q_width * seq_len

    def layer_activation_bytes(self, seq_len: int, element: int = 2) -> tuple[float, float]:
        """(all, the part tensor parallelism splits) bytes one layer keeps for backward, per sample."""
        s, e = seq_len, element
        split = e * s * (2 * self.q_width + 2 * self.kv_width + (4 if self.gated else 2) * self.intermediate)
        if self.qk_norm:  # the q and k projections' outputs before their norms
            split += e * s * (self.q_width + self.kv_width)
        normed, normed_split = self.norm_products(s, e)  # eager RMSNorm keeps its normalised tensors
        split += normed_split
        replicated = 4 * e * s * self.hidden + (normed - normed_split) + (2 * s * self.hidden if self.dropout else 0)
        return float(replicated + split), float(split)

    def layer_products(self) -> list[int]:
        """The output widths of one dense layer's matrix products, in its forward's order: q, k, v (one fused
        product under `fused_qkv`), the attention output projection, the MLP's gate and up (one under
        `fused_gate_up`; a plain MLP's first) and its down projection."""
        h, q, k, f = self.hidden, self.q_width, self.kv_width, self.intermediate
        attention = [q + 2 * k] if self.fused_qkv else [q, k, k]
        first = ([2 * f] if self.fused_gate_up else [f, f]) if self.gated else [f]
        return [*attention, h, *first, h]

    def layer_selective_bytes(self, seq_len: int, element: int = 2, matmuls: str = "all") -> float:
        """Bytes one layer keeps per sample under selective recomputation (`SAVED_OPS`): its input, the attention's
        output and its matrix products' outputs (`layer_products`): all, or with `matmuls` "alternate" the 1st,
        3rd, ... (`pipeline.recompute.selective_policy`); the norms, rotary, activation and residual sums are
        recomputed."""
        products = self.layer_products()
        kept = products if matmuls == "all" else products[::2]
        return float(element * seq_len * (self.hidden + self.q_width + sum(kept)))

    def layer_alternate_flops(self, seq_len: int) -> float:
        """Forward FLOPs per sample of the matrix products "alternate" selective recomputation runs again (the 2nd,
        4th, ... of `layer_products`; each reads `hidden` inputs but the down projection, which reads the MLP's
        width)."""
        products = self.layer_products()
        widths = [self.intermediate if i == len(products) - 1 else self.hidden for i in range(len(products))]
        return float(sum(2 * seq_len * widths[i] * products[i] for i in range(1, len(products), 2)))

    def layer_backward_bytes(self, seq_len: int, element: int = 2) -> float:
        """Bytes one layer's backward holds at once per sample beyond its saved activations, at its MLP (its first,
        and widest, part): the gradient of the down projection's input (f wide) replaces that saved input; a gated
        MLP's product then makes the gradients of both its factors (f each) from it, a plain one its activation's
        (measured by `pipetrain profile` for a `llama-cpu` layer: 2f to 0.2 %)."""
        return float(element * seq_len * (2 if self.gated else 1) * self.intermediate)

    def blocks(self, seq_len: int, *, element: int = 2, vocab_parallel: bool = False,
               logits_element: int = 4) -> list[BlockCost]:
        """The planner's costs of pipetrain's blocks (embedding, layers, head) at `seq_len`, activations of
        `element` bytes (2 under bf16 autocast, 4 in fp32), parameters counted in fp32, the head's logits of
        `logits_element` bytes (4: pipetrain casts a stage's outputs to fp32; 2: a model that returns its bf16
        logits and a loss that casts a copy, torchtitan's; the log-softmax stays fp32 either way)."""
        s, e, h, V = seq_len, element, self.hidden, self.vocab
        sh = s * h
        vocab_split = {"params": V * h, "comm_bytes": float(e * sh), "collectives": 1,
                       "divides": (("vocab_size", V),), "sequence": s, "tensors": 1}
        embed = self.embedding_params()
        blocks = [BlockCost(
            name="Embedding", params=embed, param_bytes=4.0 * embed,
            activation_bytes=float(8 * s + (sh if self.dropout else 0)), output_bytes=float(e * sh),
            forward_traffic=float(2 * e * sh), kernels=3, tensors=2 if self.positions else 1,
            fixed_backward_traffic=float(2 * 4 * embed),  # a dense gradient: zeroed and written per micro-batch
            tensor=TensorSplit(flops=0.0, traffic=0.0, activation_bytes=0.0, **vocab_split) if vocab_parallel else None,
        )]
        q, k, f = self.q_width, self.kv_width, self.intermediate
        flops = 2 * s * h * (q + 2 * k) + 2 * s * q * h + 4 * s * s * q + 2 * s * h * f * (3 if self.gated else 2)
        kept, split_act = self.layer_activation_bytes(s, e)
        traffic = e * s * (10 * h + 3 * (q + k) + 5 * f)  # norms, residuals, rotary, the MLP's activation
        weights = 4 + (3 if self.gated else 2)
        split = TensorSplit(
            params=self.matmul_params() + self.column_biases(), flops=float(flops),
            traffic=float(e * s * (3 * (q + k) + 5 * f)), activation_bytes=split_act, comm_bytes=float(e * sh),
            divides=(("num_attention_heads", self.heads), ("num_key_value_heads", self.kv_heads),
                     ("intermediate_size", f)),
            sequence=s,
            tensors=weights + (3 if self.qkv_bias else 0) + ((2 if self.gated else 1) if self.mlp_bias else 0),
        )
        layer = self.layer_params()
        tensors = weights + 2 * (2 if self.layer_norm else 1) + (2 if self.qk_norm else 0) + 3 * self.qkv_bias \
            + self.o_bias + ((3 if self.gated else 2) if self.mlp_bias else 0)
        context = self.context_split(s, e)
        for index in range(self.layers):
            if self.is_moe(index):
                blocks.append(self.moe_block(index, s, e))
                continue
            blocks.append(BlockCost(
                name=f"DecoderLayer{index}", params=layer, param_bytes=4.0 * layer, activation_bytes=kept,
                output_bytes=float(e * sh), forward_flops=float(flops), forward_traffic=float(traffic), kernels=20,
                tensors=tensors, tensor=split, matmul_params=self.matmul_params(), context=context,
                selective_bytes=self.layer_selective_bytes(s, e), backward_bytes=self.layer_backward_bytes(s, e),
                alternate_bytes=self.layer_selective_bytes(s, e, "alternate"),
                alternate_flops=self.layer_alternate_flops(s),
            ))
        head = self.head_params()
        logits = logits_element * s * V  # the logits the stage outputs (kept to the step's end)
        blocks.append(BlockCost(
            name="Head", params=head, param_bytes=4.0 * head, activation_bytes=float(2 * e * sh),
            output_bytes=float(logits), forward_flops=float(2 * s * h * V),
            forward_traffic=float(e * 3 * sh + 2 * logits), loss_bytes=log_softmax_bytes(s, V),
            kernels=6, tensors=3 if self.layer_norm else 2,
            tensor=TensorSplit(flops=float(2 * s * h * V), traffic=float(2 * logits), activation_bytes=0.0,
                               **vocab_split) if vocab_parallel else None,
        ))
        return blocks

    def moe_block(self, index: int, s: int, e: int) -> BlockCost:
        """A MoE decoder layer's costs: attention as a dense layer's, the MLP as router, top-k routed experts (the
        block's `ExpertSplit`) and the shared expert; tensor parallelism splits the attention and the shared
        expert only."""
        h, q, k, f, fs, top = self.hidden, self.q_width, self.kv_width, self.expert_intermediate, \
            self.shared_intermediate, self.top_k
        mlp_width = 3 if self.gated else 2
        attention_flops = 2 * s * h * (q + 2 * k) + 2 * s * q * h + 4 * s * s * q
        expert_flops = 2 * s * h * f * mlp_width * top
        shared_flops = 2 * s * h * fs * 3 + (2 * s * h if self.shared_gate else 0)
        flops = attention_flops + 2 * s * h * self.experts + expert_flops + shared_flops
        attention_kept = e * s * (2 * q + 2 * k + ((q + k) if self.qk_norm else 0))
        normed, normed_split = self.norm_products(s, e)
        kept = (4 * e * s * h + attention_kept + normed + e * s * top * ((4 if self.gated else 2) * f + 2 * h)
                + 4 * e * s * fs + 4 * s * self.experts + (2 * s * h if self.dropout else 0))
        attention_params = h * (q + 2 * k) + q * h
        params = self.moe_layer_params()
        split = TensorSplit(
            params=attention_params + 3 * h * fs + (q + 2 * k) * self.qkv_bias,
            flops=float(attention_flops + 2 * s * h * fs * 3), traffic=float(e * s * (3 * (q + k) + 5 * fs)),
            activation_bytes=float(attention_kept + normed_split + 4 * e * s * fs), comm_bytes=float(e * s * h),
            divides=(("num_attention_heads", self.heads), ("num_key_value_heads", self.kv_heads))
            + ((("shared_expert_intermediate_size", fs),) if fs else ()),
            sequence=s, tensors=4 + (3 if fs else 0) + (3 if self.qkv_bias else 0),
        )
        expert_tensors = 4 if self.expert_bias else 2
        tensors = (4 + expert_tensors + 1 + (1 if self.expert_bias else 0) + (3 if fs else 0)
                   + (1 if self.shared_gate else 0) + 2 * (2 if self.layer_norm else 1) + (2 if self.qk_norm else 0)
                   + 3 * self.qkv_bias + self.o_bias)
        return BlockCost(
            name=f"MoELayer{index}", params=params, param_bytes=4.0 * params, activation_bytes=float(kept),
            output_bytes=float(e * s * h), forward_flops=float(flops),
            forward_traffic=float(e * s * (10 * h + 3 * (q + k) + 5 * (top * f + fs) + 2 * top * h)), kernels=32,
            tensors=tensors, tensor=split, matmul_params=attention_params + 3 * h * fs,
            experts=ExpertSplit(experts=self.experts, top_k=top, params=self.routed_params(),
                                flops=float(expert_flops), dispatch_bytes=float(e * s * h * top),
                                tensors=expert_tensors),
            context=self.context_split(s, e),
        )

    def norm_products(self, seq_len: int, element: int = 2) -> tuple[float, float]:
        """(all, the part tensor parallelism splits) bytes per sample a layer's RMS norms keep beyond their inputs:
        transformers' RMSNorm returns `weight * (x * rsqrt(mean(x²)))`, and the weight's gradient needs that
        normalized product: h for each of the two layer norms, q + k for the q/k norms (split with the heads).
        torch's LayerNorm keeps its statistics only (per token, not per element): nothing counted."""
        if self.layer_norm:
            return 0.0, 0.0
        split = element * seq_len * (self.q_width + self.kv_width) if self.qk_norm else 0
        return float(element * seq_len * 2 * self.hidden + split), float(split)

    def context_split(self, s: int, e: int) -> ContextSplit:
        """What context parallelism exchanges in one layer's attention, per sequence of `s` tokens."""
        return ContextSplit(sequence=s, heads=self.heads, kv_heads=self.kv_heads,
                            kv_bytes=float(2 * e * s * self.kv_width), qo_bytes=float(2 * e * s * self.q_width),
                            flops=float(4 * s * s * self.q_width), element=e)

    def summary(self) -> str:
        """One line: the family and its sizes."""
        moe = (f", {sum(self.sparse)} MoE layers of {self.experts} experts ({self.expert_intermediate} wide, top "
               f"{self.top_k}{f', a shared expert {self.shared_intermediate} wide' if self.shared_intermediate else ''})"
               f"; {self.flops_params() / 1e9:.3f} B active" if self.experts else "")
        return (f"{self.model_type}: {self.layers} layers, hidden {self.hidden}, intermediate {self.intermediate}"
                f"{' (gated)' if self.gated else ''}, {self.heads} heads ({self.kv_heads} key/value) of "
                f"{self.head_dim}, "
                f"vocabulary {self.vocab}{', tied head' if self.tied else ''}; {self.params() / 1e9:.3f} B parameters"
                + moe)


def _number(config: dict[str, Any], name: str, where: str, default: Any = None) -> int:
    value = config.get(name, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: {name} is {value!r}, expected a positive integer",
                          hint=f"give the config a positive integer {name}")
    return value


def _flag(config: dict[str, Any], value: str | bool) -> bool:
    return bool(config.get(value, False)) if isinstance(value, str) else value


def sizes_from_config(config: dict[str, Any], where: str = "config.json") -> DecoderSizes:
    """The sizes of a transformers config given as a dict (a `config.json`'s contents), read through its family's
    `ConfigNames`; one ConfigError naming the model_type and the families that can be priced for any other."""
    model_type = config.get("model_type")
    names = CONFIG_NAMES.get(model_type)
    if names is None:
        raise ConfigError(
            f"{where} holds a {model_type!r} model, which the planner cannot price: it needs the sizes of a "
            "decoder-only family it knows (layers, hidden and intermediate sizes, query and key/value heads, head "
            "dimension, vocabulary, tied head, gated MLP, biases)",
            hint=f"plan a config of one of: {', '.join(CONFIG_NAMES)}; or profile the model "
                 "(`pipetrain profile`) and pass --profile FILE")
    h = _number(config, names.hidden, where)
    heads = _number(config, names.heads, where)
    kv = _number(config, names.kv_heads, where, heads) if names.kv_heads else heads
    head_dim = _number(config, "head_dim", where, h // heads if h % heads == 0 else None)
    if heads % kv:
        raise ConfigError(f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}",
                          hint="fix the config: each key/value head serves a whole group of query heads")
    width = names.intermediate_default and names.intermediate_default * h
    dropout = config.get(names.dropout, names.dropout_default) if names.dropout else 0
    layers = _number(config, names.layers, where)
    return DecoderSizes(
        **_moe_sizes(config, names, layers, where),
        model_type=model_type, layers=layers, hidden=h,
        intermediate=_number(config, names.intermediate, where, width) if names.intermediate else 0,
        heads=heads, kv_heads=kv,
        head_dim=head_dim, vocab=_number(config, "vocab_size", where),
        tied=bool(config.get("tie_word_embeddings", names.tied_default)), gated=names.gated,
        fused_qkv=names.fused_qkv, fused_gate_up=names.fused_gate_up,
        layer_norm=names.layer_norm, qkv_bias=_flag(config, names.qkv_bias), o_bias=_flag(config, names.o_bias),
        mlp_bias=_flag(config, names.mlp_bias),
        qk_norm={"head": 2 * head_dim, "projection": (heads + kv) * head_dim}.get(names.qk_norm, 0),
        positions=_number(config, names.positions, where, names.positions_default) if names.positions else 0,
        dropout=float(dropout or 0) > 0)


def _moe_sizes(config: dict[str, Any], names: ConfigNames, layers: int, where: str) -> dict[str, Any]:
    """The mixture-of-experts fields of `DecoderSizes` (none for a dense family)."""
    field = next((name for name in names.experts if config.get(name)), None)
    if field is None:
        return {}
    experts = _number(config, field, where)
    top_k = _number(config, names.top_k, where)
    if top_k > experts:
        raise ConfigError(f"{where}: {names.top_k}={top_k} is more than the {experts} experts ({field})",
                          hint="fix the config: each token goes to at most every expert")
    if names.sparse_layers == "qwen":
        dense = set(config.get("mlp_only_layers") or ())
        step = _number(config, "decoder_sparse_step", where, 1)
        sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    else:
        sparse = (True,) * layers
    shared = _number(config, names.shared_intermediate, where) if names.shared_intermediate and \
        config.get(names.shared_intermediate) else 0
    return {"experts": experts, "top_k": top_k, "sparse": sparse, "shared_intermediate": shared,
            "expert_intermediate": _number(config, names.expert_intermediate, where),
            "shared_gate": names.shared_gate and bool(shared), "expert_bias": names.expert_bias, "sinks": names.sinks}


def read_config(path: str | Path) -> tuple[dict[str, Any], Path]:
    """The JSON of a model folder's `config.json` or of a bare config file, and the file read; one ConfigError for
    a path that is neither."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if path.is_dir() and not file.is_file():
        raise ConfigError(f"model folder {str(path)!r} has no config.json",
                          hint="pass a folder written by save_pretrained, or the path of a config.json")
    if not file.is_file():
        raise ConfigError(f"--model {str(path)!r} is neither a model folder nor a config file",
                          hint="pass a folder holding config.json, or the path of a config.json")
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"cannot read {str(file)!r} as a JSON config: {err}",
                          hint="pass a transformers config.json") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{str(file)!r} is not a JSON object", hint="pass a transformers config.json")
    return config, file


def load_sizes(path: str | Path) -> DecoderSizes:
    """`sizes_from_config` of a model folder or a bare config.json (read as JSON: nothing else is loaded)."""
    config, file = read_config(path)
    return sizes_from_config(config, str(file))

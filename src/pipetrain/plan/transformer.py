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

from pathlib import Path
from typing import Any

from pipetrain.plan.config_names import CONFIG_NAMES, FAMILY_FIELDS, ConfigNames
from pipetrain.plan.config_read import read_config, size_fields
from pipetrain.plan.decoder_activations import DecoderActivations
from pipetrain.plan.loss import log_softmax_bytes
from pipetrain.plan.model import BlockCost, ContextSplit, ExpertSplit, TensorSplit

# the sizes and parameter counts: plan/decoder_shape.py; activation bytes: plan/decoder_activations.py; reading a
# config.json: plan/config_read.py
__all__ = ["DecoderSizes", "ConfigNames", "CONFIG_NAMES", "FAMILY_FIELDS", "sizes_from_config", "load_sizes", "read_config"]


class DecoderSizes(DecoderActivations):
    """What the planner needs of a decoder-only LM (see the module docstring): its sizes and parameter counts
    (`DecoderShape`), a layer's activation bytes (`DecoderActivations`), and here its FLOPs and block costs."""

    def layer_alternate_flops(self, seq_len: int) -> float:
        """Forward FLOPs per sample of the matrix products "alternate" selective recomputation runs again (the 2nd,
        4th, ... of `layer_products`; each reads `hidden` inputs but the down projection, which reads the MLP's
        width)."""
        products = self.layer_products()
        widths = [self.intermediate if i == len(products) - 1 else self.hidden for i in range(len(products))]
        return float(sum(2 * seq_len * widths[i] * products[i] for i in range(1, len(products), 2)))

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

    def context_split(self, s: int, e: int) -> ContextSplit:
        """What context parallelism exchanges in one layer's attention, per sequence of `s` tokens."""
        return ContextSplit(sequence=s, heads=self.heads, kv_heads=self.kv_heads,
                            kv_bytes=float(2 * e * s * self.kv_width), qo_bytes=float(2 * e * s * self.q_width),
                            flops=float(4 * s * s * self.q_width), element=e)


def sizes_from_config(config: dict[str, Any], where: str = "config.json") -> DecoderSizes:
    """The sizes of a transformers config given as a dict (a `config.json`'s contents), read through its family's
    `ConfigNames`; one ConfigError naming the model_type and the families that can be priced for any other."""
    return DecoderSizes(**size_fields(config, where))


def load_sizes(path: str | Path) -> DecoderSizes:
    """`sizes_from_config` of a model folder or a bare config.json (read as JSON: nothing else is loaded)."""
    config, file = read_config(path)
    return sizes_from_config(config, str(file))

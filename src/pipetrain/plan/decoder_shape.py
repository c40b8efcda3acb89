"""A decoder-only LM's sizes and what they count: parameters of each part, the 6N FLOPs, a layer's matrix products."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DecoderShape"]


@dataclass(frozen=True, kw_only=True)
class DecoderShape:
    """The sizes of a decoder-only LM and their parameter counts (`plan.transformer.DecoderSizes` adds the bytes
    and costs; see that module's docstring)."""

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

    def layer_products(self) -> list[int]:
        """The output widths of one dense layer's matrix products, in its forward's order: q, k, v (one fused
        product under `fused_qkv`), the attention output projection, the MLP's gate and up (one under
        `fused_gate_up`; a plain MLP's first) and its down projection."""
        h, q, k, f = self.hidden, self.q_width, self.kv_width, self.intermediate
        attention = [q + 2 * k] if self.fused_qkv else [q, k, k]
        first = ([2 * f] if self.fused_gate_up else [f, f]) if self.gated else [f]
        return [*attention, h, *first, h]

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

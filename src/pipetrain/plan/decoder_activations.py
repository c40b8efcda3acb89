"""The bytes a decoder layer keeps for its backward: all of them, under selective recomputation, its norms'
products, and what its backward holds at once beyond them."""

from __future__ import annotations

from pipetrain.plan.decoder_shape import DecoderShape

__all__ = ["DecoderActivations"]


class DecoderActivations(DecoderShape):
    """A decoder's sizes with the activation bytes of one layer (see `plan.transformer`'s module docstring)."""

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

    def layer_selective_bytes(self, seq_len: int, element: int = 2, matmuls: str = "all") -> float:
        """Bytes one layer keeps per sample under selective recomputation (`SAVED_OPS`): its input, the attention's
        output and its matrix products' outputs (`layer_products`): all, or with `matmuls` "alternate" the 1st,
        3rd, ... (`pipeline.recompute.selective_policy`); the norms, rotary, activation and residual sums are
        recomputed."""
        products = self.layer_products()
        kept = products if matmuls == "all" else products[::2]
        return float(element * seq_len * (self.hidden + self.q_width + sum(kept)))

    def layer_backward_bytes(self, seq_len: int, element: int = 2) -> float:
        """Bytes one layer's backward holds at once per sample beyond its saved activations, at its MLP (its first,
        and widest, part): the gradient of the down projection's input (f wide) replaces that saved input; a gated
        MLP's product then makes the gradients of both its factors (f each) from it, a plain one its activation's
        (measured by `pipetrain profile` for a `llama-cpu` layer: 2f to 0.2 %)."""
        return float(element * seq_len * (2 if self.gated else 1) * self.intermediate)

    def norm_products(self, seq_len: int, element: int = 2) -> tuple[float, float]:
        """(all, the part tensor parallelism splits) bytes per sample a layer's RMS norms keep beyond their inputs:
        transformers' RMSNorm returns `weight * (x * rsqrt(mean(x²)))`, and the weight's gradient needs that
        normalized product: h for each of the two layer norms, q + k for the q/k norms (split with the heads).
        torch's LayerNorm keeps its statistics only (per token, not per element): nothing counted."""
        if self.layer_norm:
            return 0.0, 0.0
        split = element * seq_len * (self.q_width + self.kv_width) if self.qk_norm else 0
        return float(element * seq_len * 2 * self.hidden + split), float(split)

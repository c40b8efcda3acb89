"""What the planner counts for a decoder LM priced from its config, as the lines `pipetrain plan --model` prints.

Parameters (total and, for a mixture of experts, active; what a rank holds at each ep), training FLOPs per token,
activations kept per layer and sample, what tensor and context parallelism split and move (pure: no torch).
"""

from __future__ import annotations

from pipetrain.plan.context import ring_messages
from pipetrain.plan.transformer import DecoderSizes

__all__ = ["describe"]


def describe(sizes: DecoderSizes, seq_len: int, *, element: int = 2, tp: int = 1, ep: int = 1,
             cp: int = 1) -> list[str]:
    """What the planner counts for `sizes` at `seq_len` (activations of `element` bytes; the split at `tp`; a
    mixture of experts: total and active parameters, the experts a rank holds at `ep`, the all-to-all volume)."""
    mib = 2**20
    moe = []
    if sizes.experts:
        routed = sizes.routed_params()
        moe = [f"mixture of experts: {sizes.params() / 1e9:.3f} B parameters, {sizes.flops_params() / 1e9:.3f} B "
               f"active per token (top {sizes.top_k} of {sizes.experts} experts in {sum(sizes.sparse)} layers); "
               f"routed experts {routed / 1e6:.1f} M per MoE layer, "
               + ", ".join(f"{routed / e / 1e6:.1f} M per rank at ep={e}" for e in sorted({1, 2, 4, 8, ep})
                           if sizes.experts % e == 0),
               f"all-to-all per MoE layer and sample at ep={ep}: dispatch and combine of "
               f"{element * seq_len * sizes.hidden * sizes.top_k / mib:.1f} MiB each ((ep - 1) / ep of it leaves the "
               f"rank), as much again in backward"]
    kept, split = sizes.layer_activation_bytes(seq_len, element)
    layer_input = element * seq_len * sizes.hidden
    per_layer = f"{sizes.layers} layers of {sizes.layer_params() / 1e6:.2f} M"
    if sizes.experts:  # the MoE layers' own figures (a dense layer's where some layers are dense)
        last = sizes.moe_block(sizes.layers - 1, seq_len, element)
        kept, split = last.activation_bytes, last.tensor.activation_bytes
        dense = sizes.layers - sum(sizes.sparse)
        per_layer = (f"{sum(sizes.sparse)} MoE layers of {sizes.moe_layer_params() / 1e6:.2f} M"
                     + (f" and {dense} dense of {sizes.layer_params() / 1e6:.2f} M" if dense else ""))
    lines = [
        f"parameters {sizes.params() / 1e9:.3f} B: {per_layer}, "
        f"embedding {sizes.embedding_params() / 1e6:.1f} M (first stage), head {sizes.head_params() / 1e6:.1f} M "
        f"(last stage{', a copy of the embedding: tied' if sizes.tied else ''})",
        f"training FLOPs per token {sizes.flops_per_token(seq_len):.4g} (6N + 12·L·heads·head_dim·s, N = "
        f"{sizes.flops_params() / 1e9:.3f} B: pipetrain.logs.mfu's convention; recomputation not counted)",
        f"per layer and sample at seq len {seq_len}, {element}-byte activations: {kept / mib:.1f} MiB kept for "
        f"backward without recomputation; recomputing, {layer_input / mib:.1f} MiB (checkpoint: the stage's input "
        f"per stage; --recompute-unit layer: each layer's input)",
    ]
    if tp > 1:
        rank = (kept - split + split / tp) / mib
        lines.append(f"at tp={tp}: a layer's {sizes.matmul_params() / 1e6:.1f} M projection weights and "
                     f"{split / mib:.1f} MiB of its activations split (each rank {rank:.1f} MiB; "
                     f"{kept / tp / mib:.1f} MiB with sequence parallelism), 2 all-reduces of "
                     f"{layer_input / mib:.1f} MiB per forward and per backward")
    if cp > 1:
        split = sizes.context_split(seq_len, element)
        forward, backward = ring_messages(split, cp)
        lines.append(f"at cp={cp}: each rank holds {seq_len // cp} tokens of a sequence (activations and compute / "
                     f"{cp}); per layer and sample the ring sends {sum(forward) / mib:.1f} MiB of keys and values in "
                     f"{cp - 1} step{'s' if cp > 2 else ''} forward, {sum(backward) / mib:.1f} MiB in backward (the "
                     f"parts again and their fp32 gradients, {cp} steps); all-to-all attention moves "
                     f"{(split.kv_bytes + split.qo_bytes) / cp * (cp - 1) / cp / mib:.1f} MiB, twice that in backward")
    lines.append("per parameter: fp32 16 B (weights, gradient, 2 AdamW moments; DDP +4 B of buckets); FSDP keeps the "
                 "stage's weights gathered (fp32 4 B, bf16 2 B, Float8 1 B) and its gradients (4 B) plus 16 B / dp")
    return moe + lines

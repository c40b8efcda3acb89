"""A rank's memory terms: its weights, gradients and AdamW state, FSDP's reduction buffers, and what a block keeps
for its backward under per-block recomputation."""

from __future__ import annotations

from collections.abc import Sequence

from pipetrain.errors import ConfigError
from pipetrain.plan.layout import Layout
from pipetrain.plan.model import BlockCost
from pipetrain.plan.tensor import tp_output_bytes, tp_param_bytes, tp_params

__all__ = ["static_bytes", "reduce_scatter_bytes", "block_kept_bytes"]


def block_kept_bytes(blocks: Sequence[BlockCost], index: int, layout: Layout, acts: float, chosen: bool) -> float:
    """Per sample, what block `index` keeps for its backward under a per-block unit: all its activations when not
    `chosen` to recompute; its input ("layer"); its selectively kept tensors ("selective", the input among them)."""
    if not chosen:
        return acts
    tp, sp = layout.tp, layout.sequence_parallel
    entry = tp_output_bytes(blocks[index - 1], tp, sp) if index else 0.0
    if layout.recompute_unit == "layer":
        return entry
    block = blocks[index]
    selective = block.alternate_bytes if layout.selective_matmuls == "alternate" and \
        block.alternate_bytes is not None else block.selective_bytes
    if selective is None or not block.activation_bytes:
        return acts  # nothing known to recompute cheaply: counted as kept
    return max(entry, acts * selective / block.activation_bytes)


def reduce_scatter_bytes(blocks: Sequence[BlockCost], layout: Layout) -> float:
    """What FSDP2 adds as it reduces the gradients accumulated unsharded (no resharding: once, after the stage's
    last backward, torch's `perform_reduce_grad`): block by block, `foreach_reduce` copies a block's gradients into
    one flat fp32 reduce-scatter input before it drops them, and the block's shard of the result; the first block
    reduced sets the peak (later ones have freed a block's gradients and weights first, and FSDP keeps at most one
    earlier input alive: `reduce_scatter_max_input_buffers` = 1, torch 2.13 `_fsdp_param_group.py`). Zero when
    nothing is sharded or the gradients were reduced per micro-batch (`fsdp_reshard`: `static_bytes` counts it)."""
    if layout.shards == 1 or layout.dp == 1 or layout.fsdp_reshard or not blocks:
        return 0.0
    grad = max(4.0 * tp_params(b, layout.tp) * b.trained_share for b in blocks)
    return grad * (1.0 + 1.0 / layout.shards)


def static_bytes(blocks: Sequence[BlockCost], layout: Layout, *, resting: bool = False) -> float:
    """Bytes of weights, gradients and AdamW state one rank holds for `blocks` (see `Layout.precision`).

    DDP or one replica: weights, gradients and the two moments (4 copies of the parameter bytes), DDP's buckets a
    fifth. FSDP: the stage's weights stay gathered between micro-batches and its gradients accumulate unsharded
    until the last backward, the fp32 shards (weights, gradient, two moments) are split over dp. In fp32 that is
    2 + 4/dp copies of the parameter bytes; in bf16 the gathered weights take 2 bytes per parameter (1 for Float8
    projections, `float8`), the accumulated gradients 4 (FSDP2 accumulates in its fp32 reduce dtype), the shards
    16 / dp. Frozen parameters (`BlockCost.frozen_params`, a LoRA run's base) hold their weights only: no gradient,
    no moments, no DDP bucket. With `fsdp_reshard` only two blocks' weights are gathered at once (the one computing,
    the one prefetched) and one block's unsharded gradient (reduce-scattered per micro-batch), beside the shards.
    `resting`: what is left after the last backward (the step's end): FSDP has resharded and reduced (torch's
    `perform_reduce_grad`), only the shards stay; DDP and one replica keep everything."""
    param_bytes = sum(tp_param_bytes(b, layout.tp) for b in blocks)
    trained_bytes = sum(tp_param_bytes(b, layout.tp) * b.trained_share for b in blocks)
    if layout.precision not in ("fp32", "bf16"):
        raise ConfigError(f"unknown precision {layout.precision!r} for memory", hint="use 'fp32' or 'bf16'")
    if layout.shards == 1 or layout.dp == 1:
        return param_bytes + (4 if layout.dp > 1 and layout.dp_mode == "ddp" else 3) * trained_bytes
    shards_of = layout.shards
    if layout.precision == "fp32":
        gathered, grads = [tp_param_bytes(b, layout.tp) for b in blocks], [tp_param_bytes(b, layout.tp) *
                                                                             b.trained_share for b in blocks]
        shards = (param_bytes + 3 * trained_bytes) / shards_of
    else:
        fp8 = [b.matmul_params / (layout.tp if b.tensor is not None else 1) if layout.float8 else 0.0 for b in blocks]
        gathered = [2 * (tp_params(b, layout.tp) - f) + f for b, f in zip(blocks, fp8)]
        grads = [4 * tp_params(b, layout.tp) * b.trained_share for b in blocks]
        shards = sum(4 * tp_params(b, layout.tp) * (1 + 3 * b.trained_share) for b in blocks) / shards_of
    if resting:
        return shards
    if not layout.fsdp_reshard:
        return sum(gathered) + sum(grads) + shards
    # resharded: the block computing and the one prefetched gathered, one block's unsharded gradient being reduced
    return sum(sorted(gathered)[-2:]) + max(grads, default=0.0) + shards

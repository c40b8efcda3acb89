"""A layout's stages priced per micro-batch (`StageCost`s): compute, collectives, transfers, gradient reduction and
the activation bytes each keeps, holds while recomputing and needs as its backward starts."""

from __future__ import annotations

from collections.abc import Sequence

from pipetrain.errors import ConfigError
from pipetrain.plan.context import context_comm_s, context_samples
from pipetrain.plan.events import StageCost
from pipetrain.plan.experts import ep_exchange_s, ep_extra_s, expert_layout, rank_parts
from pipetrain.plan.hardware import Device, Network
from pipetrain.plan.layout import Layout
from pipetrain.plan.memory import block_kept_bytes
from pipetrain.plan.model import BlockCost
from pipetrain.plan.overlap import can_overlap, overlap_hides
from pipetrain.plan.schedules import placement, stage_rank
from pipetrain.plan.tensor import tp_activation_bytes, tp_comm_s, tp_output_bytes, tp_param_bytes
from pipetrain.plan.times import block_times, recomputed_share, reduce_s

__all__ = ["stage_costs"]


def _crosses_node(stage: int, layout: Layout) -> bool:
    """Whether the hop from `stage` to `stage + 1` leaves the node (pipeline ranks are contiguous; stages
    placed looped or, for the V schedules, in a V)."""
    if layout.gpus_per_node <= 0:
        return False
    style = placement(layout.schedule)
    rank, nxt = stage_rank(stage, layout.pp, style), stage_rank(stage + 1, layout.pp, style)
    width = layout.tp  # a pipeline rank's tensor-parallel ranks (its cp ranks are other replicas': parallel/mesh.py)
    return rank * width // layout.gpus_per_node != nxt * width // layout.gpus_per_node


def stage_costs(blocks: Sequence[BlockCost], layout: Layout, device: Device, network: Network,
                bounds: Sequence[tuple[int, int]]) -> list[StageCost]:
    """The per-micro-batch cost of each stage (stage s holds blocks `bounds[s]`)."""
    sequences = layout.batch // layout.dp // layout.chunks
    samples = context_samples(sequences, layout.cp)  # a CP rank's share costs as much as this many sequences
    grads = layout.gradient_layout()
    slowdown = 1.0 + (device.pipeline_slowdown if layout.pp > 1 else 0.0)
    tp, sp = layout.tp, layout.sequence_parallel
    costs = []
    for stage, (start, stop) in enumerate(bounds):
        part = blocks[start:stop]
        times = [(f * slowdown, b * slowdown) for f, b in (block_times(b, samples, device, tp, sp) for b in part)]
        comm = sum(tp_comm_s(b, samples, tp, network) for b in part)  # per forward, and as much per backward
        moe = [ep_extra_s(b, samples, layout, network, device) for b in part] \
            + [context_comm_s(b, sequences, layout, network, device) for b in part]
        moe_forward, moe_backward = sum(m[0] for m in moe), sum(m[1] for m in moe)
        hides = layout.moe_overlap and can_overlap(layout) and overlap_hides(device)
        exchanges = [ep_exchange_s(b, samples, layout, network) for b in part] if hides else []
        hide_forward, hide_backward = sum(x[0] for x in exchanges), sum(x[1] for x in exchanges)
        dense, shares = rank_parts(part, layout.ep)
        out_bytes = tp_output_bytes(part[-1], tp, sp) * samples
        across = _crosses_node(stage, layout)
        latency = network.inter_latency_s if across else network.p2p_latency_s
        bandwidth = network.inter_bytes_per_s if across else network.p2p_bytes_per_s
        backward = sum(t[1] for t in times)
        held = again = None
        acts = [device.activation_factor * tp_activation_bytes(b, tp, sp) for b in part]
        # selective recomputation leaves the model's last block (the head) plain: its policy would keep the logits
        chosen = [i for i in range(start, stop) if (i + 1) % layout.recompute_every == 0
                  and not (layout.recompute_unit == "selective" and i == len(blocks) - 1)]
        # torch's stage holds each micro-batch's output from its forward to its backward (`fwd_cache`, stage.py),
        # none of its blocks' saved tensors (a block ending in a residual sum saves nothing of it); the last stage's
        # output (the logits) dies with the loss's forward, which runs in the stage's (plan/loss.py)
        middle = samples * tp_output_bytes(part[-1], tp, sp) if stop < len(blocks) else 0.0
        # as each backward starts: what a block's backward computes before the saved tensors it frees
        # (`BlockCost.backward_bytes`), the blocks after it freed already
        works = [b.backward_bytes / (tp if b.tensor is not None else 1) for b in part]
        work = max([w - sum(acts[j + 1:]) for j, w in enumerate(works)] + [0.0])
        if layout.recompute_unit in ("layer", "selective"):
            kept = [block_kept_bytes(blocks, i, layout, acts[i - start], i in chosen) for i in range(start, stop)]
            output = tp_output_bytes(part[-1], tp, sp) if stop < len(blocks) else 0.0
            held = samples * (sum(kept) + output)
            # recomputing one block at a time brings back its activations (and its backward works) while the
            # blocks before it keep what they kept; the blocks after it have run their backward and freed theirs
            again = max([held] + [samples * (sum(kept[:i - start]) + acts[i - start] + output + works[i - start])
                                  for i in chosen])
        elif layout.recompute_unit != "stage":
            raise ConfigError(f"unknown recomputation unit {layout.recompute_unit!r}",
                              hint="use 'stage', 'layer' or 'selective'")
        elif stop < len(blocks):  # the whole stage recomputed: its input and output kept; then all, and work
            held = (samples * tp_output_bytes(blocks[start - 1], tp, sp) if start else 0.0) + middle
            again = samples * (sum(acts) + work) + middle
        forward = sum(t[0] for t in times)
        redo = forward if layout.recompute_unit == "stage" else sum(
            recomputed_share(blocks[i], layout) * times[i - start][0] for i in chosen)
        moved = samples * sum(acts) / device.host_bytes_per_s if layout.offload else 0.0  # each way, overlapped
        costs.append(StageCost(
            forward_s=forward + comm + moe_forward + max(0.0, moved - forward),
            backward_s=backward + comm + moe_backward + max(0.0, moved - backward),
            activation_bytes=samples * device.activation_factor * sum(tp_activation_bytes(b, tp, sp) for b in part)
            + middle, transient_bytes=samples * work if stop < len(blocks) else 0.0,  # the last's: plan/loss.py
            input_bytes=samples * (tp_output_bytes(blocks[start - 1], tp, sp) if start else 0.0),
            send_s=latency + out_bytes / bandwidth if stop < len(blocks) else 0.0,
            reduce_s=reduce_s(sum(tp_param_bytes(b, tp) * b.trained_share for b in dense), grads, network,
                              groups=len(part) + 1)
            + (reduce_s(sum(b.param_bytes * b.trained_share for b in shares), expert_layout(grads), network,
                        groups=len(shares)) if shares else 0.0),
            weight_share=0.5 * backward / (backward + comm) if comm else 0.5,  # the weight half has no collective
            held_bytes=held, recompute_bytes=again, recompute_s=redo + comm,
            exchange_forward_s=hide_forward, exchange_backward_s=hide_backward,
        ))
    return costs

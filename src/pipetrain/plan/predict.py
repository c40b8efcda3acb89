"""Predict one layout's step time, throughput, per-stage peak memory and bubble (pure: plain data in and out).

Step time = the simulated schedule (`simulate` on the schedule's real order, with per-stage compute from the block
costs and the device, point-to-point transfers and the data-parallel gradient reduction from the network) + the
optimizer step (AdamW over the rank's parameters) + one small collective (the step's metrics) + the device's fixed
host cost per step (`Device.step_overhead_s`, plan/overheads.py). Memory per rank = parameters, gradients and the
two AdamW moments (4 copies of the parameter bytes; FSDP keeps the stage's parameters and gradients gathered, the
rest sharded over dp; DDP adds its gradient buckets; bf16 and Float8 under FSDP: `static_bytes`; FSDP resharding
after forward: two blocks' weights gathered and one block's gradient unsharded) + the simulated activation peak (a
recomputing micro-batch keeps its stage's input, with `recompute_unit="layer"` every (K-th) block's input, with
"selective" every block's `selective_bytes`; offloading: at most three micro-batches' activations on the device; the
last stage's loss and kept outputs: plan/loss.py) + the receive buffers torch's stages allocate per micro-batch
(input but on the first stage, gradient but on the last) + the device's baseline (CPU: memory before the model).
The peak is the largest of three moments: the schedule running (all the static bytes and the simulated peak, the
loss's backward temporaries included), FSDP's reduction after the last backward (`reduce_scatter_bytes` beside the
kept outputs) and the step's end (the kept outputs merged; FSDP holds only its shards then: `static_bytes(resting)`).
A rank holds the stages `rank_stages` names: looped (r, r + pp, ...) or, for zbv and dualpipev, in a V
(r and 2pp-1-r); the activation peak is the simulated one of the rank's own order (both its stages).
With tensor parallelism (`tp` > 1, plan/tensor.py) each figure is one of the tp ranks': its share of the
parameters, activations and compute, plus the TP collectives, added to every forward and backward (on the
critical path: a recomputed forward pays them again; zero-bubble's weight half W carries none).
A mixture-of-experts block's routed experts are divided over `ep` ranks of the stage's data-parallel group
(plan/experts.py): a rank holds the dense part of each block and its share of the experts, reduces the experts'
gradients over the dp / ep ranks holding the same ones, and pays the dispatch and combine all-to-alls and the
busiest expert's excess work in every forward and backward; under DualPipeV with `moe_overlap` a fused
forward-and-backward pair hides each half's all-to-alls behind the other's compute (plan/overlap.py; not on CPU).
With context parallelism (`cp` > 1, plan/context.py) each of a stage's cp ranks holds 1/cp of every sequence: it
costs what a micro-batch of samples / cp sequences costs, plus each attention layer's exchange (the ring's
key/value passes beyond the attention they overlap, or all-to-all attention's four all-to-alls); its parameters
are whole and their gradients reduced (or FSDP-sharded) over dp · cp ranks; under HSDP a shard group is
dp_shard replicas with their cp ranks: the sharded state divides by dp_shard · cp, the FSDP collectives run over
those ranks and the all-reduce across the dp / dp_shard groups (`Layout.gradient_layout`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from pipetrain.errors import ConfigError
from pipetrain.partition.solver import solve_balance, uniform_balance
from pipetrain.plan.context import context_samples, cp_problem
from pipetrain.plan.experts import ep_cp_problem, ep_problem, expert_layout, rank_parts
from pipetrain.plan.hardware import Device, Network
from pipetrain.plan.layout import Layout
from pipetrain.plan.loss import last_stage
from pipetrain.plan.memory import reduce_scatter_bytes, static_bytes
from pipetrain.plan.model import BlockCost
from pipetrain.plan.schedules import Action, placement, rank_stages, schedule_order
from pipetrain.plan.simulate import clear_cache, recomputed_microbatches, simulate
from pipetrain.plan.stage_costs import _crosses_node, stage_costs  # noqa: F401 (_crosses_node: its old import path)
from pipetrain.plan.tensor import tp_problem
from pipetrain.plan.times import SELECTIVE_RECOMPUTE_SHARE, block_times, optimizer_s, rank_speeds, reduce_s

# Layout, the time, memory and stage terms live in plan/layout.py, times.py, memory.py and stage_costs.py; their
# names stay importable from here
__all__ = ["Layout", "Prediction", "SELECTIVE_RECOMPUTE_SHARE", "predict", "static_bytes", "reduce_scatter_bytes",
           "stage_costs",
           "block_times", "optimizer_s", "rank_speeds", "order_of", "reduce_s", "clear_caches"]


@dataclass(frozen=True)
class Prediction:
    """Predicted figures of one layout: seconds, samples per second, bytes per pipeline rank."""

    layout: Layout
    step_s: float
    samples_per_s: float
    memory_bytes: tuple[float, ...]
    bubble: float
    balance: tuple[int, ...]


@lru_cache(maxsize=4096)
def order_of(schedule: str, pp: int, chunks: int, virtual: int) -> tuple[tuple[Action, ...], ...]:
    """`schedule_order`, cached (the order depends only on these four numbers)."""
    return tuple(tuple(actions) for actions in schedule_order(schedule, pp, chunks, virtual))


def clear_caches() -> None:
    """Forget the cached schedule orders and time balances (to time a cold search)."""
    order_of.cache_clear()
    _time_balance.cache_clear()
    clear_cache()


def _balance(blocks: Sequence[BlockCost], layout: Layout, samples: int, device: Device) -> list[int]:
    stages = layout.pp * layout.virtual
    if stages > len(blocks):
        raise ConfigError(f"pp={layout.pp} x {layout.virtual} virtual stages needs {stages} blocks, the model has "
                          f"{len(blocks)}", hint=f"use pp <= {len(blocks) // layout.virtual}")
    if layout.balance == "time":
        times = (sum(block_times(b, samples, device, layout.tp, layout.sequence_parallel)) for b in blocks)
        return list(_time_balance(tuple(times), stages))
    return uniform_balance(len(blocks), stages)


@lru_cache(maxsize=4096)
def _time_balance(times: tuple[float, ...], stages: int) -> tuple[int, ...]:
    return tuple(solve_balance(times, stages))


def predict(blocks: Sequence[BlockCost], layout: Layout, device: Device, network: Network) -> Prediction:
    """Simulate `layout` on the model `blocks` (see the module docstring for what is counted)."""
    local = layout.batch // layout.dp
    if layout.batch % layout.dp or local % layout.chunks:
        raise ConfigError(f"batch {layout.batch} does not split into dp={layout.dp} x chunks={layout.chunks} "
                          "equal micro-batches", hint="choose a batch divisible by dp * chunks")
    samples = context_samples(local // layout.chunks, layout.cp)
    problem = tp_problem(blocks, layout.tp, layout.sequence_parallel, layout.cp)
    if problem:
        raise ConfigError(problem, hint="choose a tp that divides the model's heads, hidden and feed-forward sizes")
    problem = ep_problem(blocks, layout.ep, layout.dp, layout.dp_shard if layout.dp_mode == "hsdp" else None)
    if problem:
        raise ConfigError(problem, hint="choose an ep that divides the experts and dp, and under hsdp the shard group "
                                        "(ep 1 on a dense model)")
    problem = cp_problem(blocks, layout.cp, layout.cp_attention)
    if problem:
        raise ConfigError(problem, hint="choose a cp that splits the sequence (and, all-to-all, the heads)")
    problem = ep_cp_problem(layout)
    if problem:
        raise ConfigError(problem, hint="choose pp 1 and tp 1 with ep and cp, or ep 1 (or cp 1)")
    if layout.gpus_per_node and layout.gpus_per_node % layout.tp:
        raise ConfigError(f"tp={layout.tp} would put a tensor-parallel group across nodes of {layout.gpus_per_node} "
                          "GPUs", hint=f"choose a tp that divides {layout.gpus_per_node}")
    balance = _balance(blocks, layout, samples, device)
    bounds = [(sum(balance[:i]), sum(balance[:i + 1])) for i in range(len(balance))]
    costs = stage_costs(blocks, layout, device, network, bounds)
    costs[-1] = last_stage(costs[-1], blocks[-1], samples, layout.tp, keep=layout.keep_outputs)  # plan/loss.py
    order = order_of(layout.schedule, layout.pp, layout.chunks, layout.virtual)
    speeds = rank_speeds(device, layout)
    timeline = simulate(order, costs, recomputed=recomputed_microbatches(layout.checkpoint, layout.chunks),
                        overhead_s=device.action_overhead_s, speeds=speeds)
    memory, optimizer = [], 0.0
    for rank in range(layout.pp):
        held = rank_stages(rank, layout.pp, layout.virtual, placement(layout.schedule))
        mine = [blocks[i] for s in held for i in range(*bounds[s])]
        grads = layout.gradient_layout()
        sharded = grads.shards > 1 and grads.dp > 1
        dense, shares = rank_parts(mine, layout.ep)
        experts = expert_layout(grads)
        static = static_bytes(dense, grads) + (static_bytes(shares, experts) if shares else 0.0)
        buffers = layout.chunks * sum(costs[s].input_bytes + (costs[s + 1].input_bytes if s + 1 < len(costs) else 0)
                                      for s in held)
        activations = timeline.running_bytes[rank]
        if layout.offload:  # on the device: the micro-batch computing, the one coming back, the step's last
            activations = min(activations, 3 * sum(costs[s].activation_bytes for s in held))
        kept = timeline.kept_bytes[rank]
        resting = static_bytes(dense, grads, resting=True) + (static_bytes(shares, experts, resting=True)
                                                              if shares else 0.0)
        moments = (static + activations,  # the schedule running
                   static + kept + reduce_scatter_bytes(mine, grads),  # FSDP's reduction after the last backward
                   resting + 2 * kept)  # the step's end: the kept outputs merged (FSDP resharded)
        memory.append(device.baseline_bytes + max(moments) + buffers)
        expert_shards = experts.dp if layout.dp_mode == "fsdp" and experts.dp > 1 else 1
        optimizer = max(optimizer, optimizer_s(dense, device, grads.shards if sharded else 1, layout.tp)
                        + (optimizer_s(shares, device, expert_shards) if shares else 0.0))
    optimizer /= speeds[-1] if speeds else 1.0  # every rank steps its optimizer at once
    step = timeline.span_s + optimizer + network.collective_latency_s + device.step_overhead_s
    return Prediction(layout, step, layout.batch / step, tuple(memory), timeline.bubble, tuple(balance))

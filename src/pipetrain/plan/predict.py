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
busiest expert's excess work in every forward and backward.
With context parallelism (`cp` > 1, plan/context.py) each of a stage's cp ranks holds 1/cp of every sequence: it
costs what a micro-batch of samples / cp sequences costs, plus each attention layer's exchange (the ring's
key/value passes beyond the attention they overlap, or all-to-all attention's four all-to-alls); its parameters
are whole and their gradients reduced (or FSDP-sharded) over dp · cp ranks; under HSDP a shard group is
dp_shard replicas with their cp ranks: the sharded state divides by dp_shard · cp, the FSDP collectives run over
those ranks and the all-reduce across the dp / dp_shard groups (`Layout.gradient_layout`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

from pipetrain.errors import ConfigError
from pipetrain.partition.solver import solve_balance, uniform_balance
from pipetrain.plan.context import context_comm_s, context_replicas, context_samples, cp_problem
from pipetrain.plan.experts import ep_cp_problem, ep_extra_s, ep_problem, expert_layout, rank_parts
from pipetrain.plan.hardware import Device, Network
from pipetrain.plan.loss import last_stage
from pipetrain.plan.model import BlockCost
from pipetrain.plan.schedules import Action, placement, rank_stages, schedule_order, stage_rank
from pipetrain.plan.simulate import StageCost, clear_cache, recomputed_microbatches, simulate
from pipetrain.plan.tensor import (tp_activation_bytes, tp_comm_s, tp_flops, tp_output_bytes, tp_param_bytes,
                                   tp_params, tp_problem, tp_traffic)

__all__ = ["Layout", "Prediction", "SELECTIVE_RECOMPUTE_SHARE", "predict", "static_bytes", "reduce_scatter_bytes",
           "stage_costs",
           "block_times", "optimizer_s", "rank_speeds", "order_of", "reduce_s", "clear_caches"]


@dataclass(frozen=True, kw_only=True)
class Layout:
    """One way to run the job. `balance` "uniform" (equal block counts) or "time" (solver on block times);
    `tp` tensor-parallel ranks per pipeline rank (innermost: a TP group's ranks are consecutive, on one node)."""

    dp: int
    pp: int
    batch: int
    chunks: int
    schedule: str = "1f1b"
    virtual: int = 1
    checkpoint: str = "never"
    dp_mode: str = "ddp"
    balance: str = "uniform"
    gpus_per_node: int = 0  # 0: every rank on one node
    tp: int = 1
    sequence_parallel: bool = False
    #: "fp32" (weights, gradients and AdamW state in the blocks' parameter bytes) or "bf16" (pipetrain's autocast:
    #: fp32 weights and state; FSDP gathers the weights in bf16 and accumulates gradients in fp32)
    precision: str = "fp32"
    #: what-if: Float8 projections whose FSDP all-gather is in float8 (gathered at 1 byte; torchtitan's
    #: `enable_fsdp_float8_all_gather`); pipetrain's engine has no Float8
    float8: bool = False
    #: what recomputation checkpoints: "stage" (the whole stage, keeping its input), "layer" (each block alone,
    #: keeping every block's input: torchtitan's and Megatron's full recomputation) or "selective" (each block
    #: keeping its matrix products' and attention's outputs, `BlockCost.selective_bytes`)
    recompute_unit: str = "stage"
    #: expert parallelism: each MoE block's routed experts divided over `ep` ranks of its stage's dp group
    ep: int = 1
    #: the busiest expert's tokens over the mean (1.0: a perfectly balanced router; matters at ep > 1)
    moe_imbalance: float = 1.0
    #: context parallelism: each sequence split over `cp` ranks of a stage (pp · tp apart, as train's mesh), and
    #: their attention
    cp: int = 1
    cp_attention: str = "ring"
    #: with unit "layer" or "selective": only every K-th block recomputes (the others keep all their activations)
    recompute_every: int = 1
    #: with unit "selective": the matrix products each block keeps, "all" or "alternate" (every other one:
    #: `BlockCost.alternate_bytes`, its recomputed products `alternate_flops`)
    selective_matmuls: str = "all"
    #: FSDP only: weights resharded after each block's forward (gathered again for its backward) and gradients
    #: reduce-scattered per micro-batch, accumulated sharded (`--fsdp-reshard always`; see plan/reshard.py)
    fsdp_reshard: bool = False
    #: activations of micro-batches waiting for their backward held in host memory (`--offload-activations`)
    offload: bool = False
    #: with dp_mode "hsdp": data replicas of one shard group (FSDP within, replicas across: `--dp-shard`); with cp
    #: a shard group is those replicas with their cp ranks (dp_shard · cp ranks hold a parameter's shards)
    dp_shard: int = 0
    #: what-if: the last stage's outputs kept by torch's schedule to the step's end and merged there (torchtitan's
    #: loop); pipetrain's engine drops each micro-batch's once its loss and metrics are computed (plan/loss.py)
    keep_outputs: bool = False

    @property
    def shards(self) -> int:
        """Ranks a parameter is sharded over: dp under FSDP, the shard group under HSDP, else 1 (of one cp rank's
        replicas: `gradient_layout` counts the cp ranks in)."""
        if self.dp_mode == "hsdp":
            return self.dp_shard or self.dp
        return self.dp if self.dp_mode == "fsdp" else 1

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp * self.cp

    def gradient_layout(self) -> Layout:
        """The layout whose dp is every rank a stage's gradients are reduced over (its replicas and its CP ranks);
        under HSDP its shard groups hold their replicas' CP ranks too (dp_shard · cp ranks, as train's mesh)."""
        if self.cp == 1:
            return self
        shard = self.dp_shard * self.cp if self.dp_mode == "hsdp" and self.dp_shard else self.dp_shard
        return replace(self, dp=context_replicas(self), cp=1, dp_shard=shard)


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


def block_times(block: BlockCost, samples: int, device: Device, tp: int = 1,
                sequence_parallel: bool = False) -> tuple[float, float]:
    """(forward, backward) compute seconds of one block on a micro-batch of `samples` (on one of `tp` ranks:
    its share of the FLOPs and traffic; the TP collectives are `tensor.tp_comm_s`)."""
    flops = tp_flops(block, tp)
    if block.forward_flops and device.rate_by_samples:  # a measured whole-layer rate: overheads included
        # a layer split tp ways does the work per kernel of the whole layer on samples * flops / forward_flops
        per_sample, fixed = flops / device.flops_at(samples * flops / block.forward_flops), 0.0
    else:
        per_sample = flops / device.flops_per_s + tp_traffic(block, tp, sequence_parallel) / device.bytes_per_s
        fixed = block.kernels * device.kernel_overhead_s
    forward = fixed + block.fixed_forward_s + samples * (per_sample + block.forward_s)
    backward = (2 * fixed + block.fixed_backward_s + samples * (2 * per_sample + block.backward_s)
                + block.fixed_backward_traffic / device.bytes_per_s)
    return forward, backward


def optimizer_s(blocks: Sequence[BlockCost], device: Device, shards: int = 1, tp: int = 1) -> float:
    """AdamW's step over the parameters of `blocks` (a per-tensor loop; FSDP: `shards` slices of each; one of
    `tp` ranks: its share), plus DTensor's dispatch on every DTensor parameter: all of them under FSDP
    (`shards` > 1), the split blocks' under tensor parallelism."""
    params = sum(tp_params(b, tp) * b.trained_share for b in blocks) / shards  # frozen parameters: no step
    tensors = sum(b.tensors for b in blocks)
    if shards > 1:
        dtensors = tensors
    else:
        dtensors = sum(b.tensor.tensors for b in blocks if b.tensor is not None) if tp > 1 else 0
    return (params * device.optimizer_s_per_param + tensors * device.optimizer_s_per_tensor
            + dtensors * device.optimizer_s_per_dtensor)


def rank_speeds(device: Device, layout: Layout) -> tuple[float, ...]:
    """Entry n - 1: how fast each of n computing ranks of a pipeline runs when the ranks of a node share its
    `device.cores` CPU cores (the node's other ranks, dp replicas included, busy in the same proportion);
    () when every rank has its own device."""
    if not device.cores and not device.contention:
        return ()
    node = min(layout.gpus_per_node or layout.world_size, layout.world_size)
    speeds = []
    for n in range(1, layout.pp + 1):
        busy = max(node * n / layout.pp, 1.0)
        cores = min(busy, device.cores) if device.cores else busy
        speeds.append(cores / busy / (1.0 + device.contention * (cores - 1)))
    return tuple(speeds)


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


def _crosses_node(stage: int, layout: Layout) -> bool:
    """Whether the hop from `stage` to `stage + 1` leaves the node (pipeline ranks are contiguous; stages
    placed looped or, for the V schedules, in a V)."""
    if layout.gpus_per_node <= 0:
        return False
    style = placement(layout.schedule)
    rank, nxt = stage_rank(stage, layout.pp, style), stage_rank(stage + 1, layout.pp, style)
    width = layout.tp  # a pipeline rank's tensor-parallel ranks (its cp ranks are other replicas': parallel/mesh.py)
    return rank * width // layout.gpus_per_node != nxt * width // layout.gpus_per_node


def reduce_s(param_bytes: float, layout: Layout, network: Network, groups: int = 0) -> float:
    """Ring all-reduce (DDP) or reduce-scatter + two all-gathers (FSDP) of one stage over dp replicas, once per
    micro-batch when FSDP reshards (`Layout.fsdp_reshard`); FSDP also pays `network.fsdp_group_s` for each of its
    `groups` (parameter groups: the stage's blocks and root) each time."""
    n = layout.dp
    if n == 1:
        return 0.0
    across = layout.gpus_per_node > 0 and layout.world_size > layout.gpus_per_node
    latency, bandwidth = (network.across_collective() if across
                          else (network.collective_latency_s, network.collective_bytes_per_s))
    sharded = layout.dp_mode in ("fsdp", "hsdp")
    if layout.dp_mode == "hsdp":  # FSDP within a shard group (a node), then an all-reduce of the shards across
        inner = replace(layout, dp_mode="fsdp", dp=layout.shards, gpus_per_node=0)
        replicas = n // layout.shards
        return (reduce_s(param_bytes, inner, network, groups) +
                (2.0 * (replicas - 1) / replicas * param_bytes / layout.shards / bandwidth + 2 * (replicas - 1)
                 * latency if replicas > 1 else 0.0))
    # FSDP resharding after forward: each micro-batch gathers the weights twice (forward, backward) and
    # reduce-scatters its gradients; else the weights are gathered and the gradients reduced once per step
    rounds = layout.chunks if sharded and layout.fsdp_reshard else 1
    volume = rounds * (3.0 if sharded else 2.0) * (n - 1) / n * param_bytes
    fixed = rounds * groups * network.fsdp_group_s if sharded else 0.0
    return volume / bandwidth + 2 * (n - 1) * latency + fixed


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
            kept = [_kept_bytes(blocks, i, layout, acts[i - start], i in chosen) for i in range(start, stop)]
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
            _recomputed_share(blocks[i], layout) * times[i - start][0] for i in chosen)
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
        ))
    return costs


#: the share of a block's forward time selective recomputation runs again (its cheap ops: norms, activations,
#: elementwise; the matrix products and attention are kept): their share of a transformer layer's time at scale
SELECTIVE_RECOMPUTE_SHARE = 0.1


def _recomputed_share(block: BlockCost, layout: Layout) -> float:
    """The share of `block`'s forward time its recomputation runs again: all of it (a whole block), the cheap ops
    (selective), and under "alternate" the FLOPs of the matrix products it did not keep."""
    if layout.recompute_unit != "selective":
        return 1.0
    extra = block.alternate_flops / block.forward_flops if layout.selective_matmuls == "alternate" and \
        block.forward_flops else 0.0
    return min(1.0, SELECTIVE_RECOMPUTE_SHARE + extra)


def _kept_bytes(blocks: Sequence[BlockCost], index: int, layout: Layout, acts: float, chosen: bool) -> float:
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


def predict(blocks: Sequence[BlockCost], layout: Layout, device: Device, network: Network) -> Prediction:
    """Simulate `layout` on the model `blocks` (see the module docstring for what is counted)."""
    local = layout.batch // layout.dp
    if layout.batch % layout.dp or local % layout.chunks:
        raise ConfigError(f"batch {layout.batch} does not split into dp={layout.dp} x chunks={layout.chunks} "
                          "equal micro-batches", hint="choose a batch divisible by dp * chunks")
    samples = context_samples(local // layout.chunks, layout.cp)
    problem = tp_problem(blocks, layout.tp, layout.sequence_parallel)
    if problem:
        raise ConfigError(problem, hint="choose a tp that divides the model's heads, hidden and feed-forward sizes")
    problem = ep_problem(blocks, layout.ep, layout.dp)
    if problem:
        raise ConfigError(problem, hint="choose an ep that divides the experts and dp (ep 1 on a dense model)")
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

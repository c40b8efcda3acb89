"""The layout search: enumerate every layout of a GPU count, drop those that do not fit, rank the rest.

Exact and fast by branch and bound: each candidate gets a cheap lower bound on its step time (the busiest
rank's compute, its gradient reduction and its optimizer step: a rank runs its actions one at a time, so
the simulated span is never shorter); candidates are simulated in order of that bound, and the search
stops when the next bound is slower than the `top`-th best fitting layout found. Every layout that was
simulated and does not fit is reported with its memory per stage.

Tensor parallelism: `SearchSpace.tps` lists the degrees to try (default 1 only); a degree is enumerated only
where it divides the GPUs of a node (so a TP group never leaves its node: ranks are dp × pp × tp with tp
innermost) and the GPU count, and `search` keeps only those the model splits into (`tensor.tp_problem`).
Where a degree may run with or without sequence parallelism, only the former is searched: it moves the same
collective volume in the same time and holds less (activations, receive buffers) and moves less (memory
traffic, stage-to-stage bytes), so it is never slower nor larger in this model.

Expert parallelism: `SearchSpace.eps` lists the degrees to try for a mixture-of-experts model (default 1 only);
a degree is enumerated where it divides dp and every MoE block's experts (`experts.ep_problem`). Context
parallelism: `SearchSpace.cps` lists the degrees that split each sequence (default 1 only); a degree takes its
ranks as train's mesh does (pp · tp apart: its exchange crosses nodes where cp · pp · tp ranks do not fit in one,
plan/context.py) and is kept where it splits
the sequence and, for all-to-all attention, the heads (`context.cp_problem`). HSDP (`dp_modes` with "hsdp"): a
shard group is the data replicas of one node with their cp ranks (train's mesh: rank = ((replica · cp + cp rank)
· pp + pp rank) · tp + tp rank), or `SearchSpace.dp_shard` replicas when given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from pipetrain.config import SPLIT_BACKWARD_SCHEDULES
from pipetrain.errors import ConfigError
from pipetrain.plan.context import context_samples, cp_problem
from pipetrain.plan.experts import ep_problem, expert_layout, rank_parts
from pipetrain.plan.hardware import Device, Network
from pipetrain.plan.model import BlockCost
from pipetrain.plan.predict import (SELECTIVE_RECOMPUTE_SHARE, Layout, Prediction, block_times, optimizer_s, predict,
                                    reduce_s)
from pipetrain.plan.reshard import reshard_after_forward
from pipetrain.plan.schedules import MULTI_STAGE_SCHEDULES, SIMULATED_SCHEDULES, V_SCHEDULES, min_microbatches
from pipetrain.plan.tensor import tp_comm_s, tp_param_bytes, tp_problem

__all__ = ["SearchSpace", "SearchResult", "enumerate_layouts", "search", "lower_bound_s", "tp_options"]


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """What may vary. `max_chunks` bounds micro-batches per replica; `virtual` the interleaved depths (the
    V schedules always have 2 stages per rank); `tps` the tensor-parallel degrees and `sequence_parallel`
    whether they run with sequence parallelism (False, True or both; tp = 1 has none)."""

    schedules: tuple[str, ...] = SIMULATED_SCHEDULES
    checkpoints: tuple[str, ...] = ("never", "except_last", "always")
    dp_modes: tuple[str, ...] = ("ddp", "fsdp")
    balances: tuple[str, ...] = ("uniform", "time")
    virtual: tuple[int, ...] = (2, 4)
    max_chunks: int = 64
    max_pp: int | None = None
    only_pp: int | None = None
    tps: tuple[int, ...] = (1,)
    sequence_parallel: tuple[bool, ...] = (False, True)
    #: carried into every layout (`Layout`'s fields of the same names): memory precision and the what-ifs
    precision: str = "fp32"
    float8: bool = False
    keep_outputs: bool = False
    recompute_unit: str = "stage"
    recompute_every: int = 1
    #: FSDP's resharding after forward: "never", "always", "auto" (plan/reshard.py: at pp 1 always; in a pipeline
    #: only where the layout would not fit with its weights gathered) or "both" (each FSDP layout both ways)
    fsdp_reshard: str = "never"
    #: whether to consider activation offloading (False, True or both)
    offload: tuple[bool, ...] = (False,)
    #: consider only this many micro-batches per replica (None: every power of 2 up to `max_chunks`)
    only_chunks: int | None = None
    #: expert-parallel degrees to try (a mixture-of-experts model), and the router's imbalance (`Layout`'s)
    eps: tuple[int, ...] = (1,)
    moe_imbalance: float = 1.0
    #: context-parallel degrees to try, and the attention they use (`Layout`'s)
    cps: tuple[int, ...] = (1,)
    cp_attention: str = "ring"
    #: HSDP's shard group in data replicas (`--dp-shard`; None: the replicas of one node)
    dp_shard: int | None = None


@dataclass
class SearchResult:
    """The best fitting predictions (fastest first), the fastest ones that did not fit, and the counts."""

    best: list[Prediction]
    too_big: list[Prediction] = field(default_factory=list)
    enumerated: int = 0
    simulated: int = 0


def _chunk_options(local: int, pp: int, space: SearchSpace) -> list[int]:
    if space.only_chunks is not None:
        return [space.only_chunks] if local % space.only_chunks == 0 else []
    return [c for c in (1 << k for k in range(0, 31)) if c <= min(local, space.max_chunks) and local % c == 0]


def tp_options(gpus: int, space: SearchSpace, gpus_per_node: int = 0) -> list[tuple[int, bool]]:
    """The (tp, sequence parallelism) pairs of `space` whose TP groups fit in a node and divide `gpus`."""
    node = gpus_per_node or gpus
    options = []
    for tp in sorted(set(space.tps)):
        if tp < 1 or gpus % tp or node % tp:
            continue
        options += [(1, False)] if tp == 1 else [(tp, sp) for sp in sorted(set(space.sequence_parallel))]
    return options


def enumerate_layouts(num_blocks: int, gpus: int, batch: int, space: SearchSpace, gpus_per_node: int = 0,
                      tps: list[tuple[int, bool]] | None = None) -> list[Layout]:
    """Every valid layout of exactly `gpus` ranks (dp * pp * tp = gpus) for a global `batch`; `tps`: the
    (tp, sequence parallelism) pairs to use (default: `tp_options`); every ep of `space.eps` that divides dp."""
    layouts = []
    for tp, sp in tp_options(gpus, space, gpus_per_node) if tps is None else tps:
        for cp in sorted(set(space.cps)):
            if cp < 1 or (gpus // tp) % cp or (cp > 1 and sp):  # cp cuts the sequence: not sequence parallelism too
                continue
            found = _layouts(num_blocks, gpus // tp // cp, batch, space, gpus_per_node, tp, sp, cp)
            if cp > 1:  # the cp ranks reduce gradients as data ranks: FSDP2 under tp or a split backward, as with dp
                found = [replace(lay, dp_mode="fsdp") if lay.dp == 1 and _needs_fsdp(lay, tp) else lay for lay in found
                         if lay.dp_mode != "ddp" or lay.dp == 1 or not _needs_fsdp(lay, tp)]
            layouts += [replace(lay, cp=cp, cp_attention=space.cp_attention) if cp > 1 else lay for lay in found]
    return [replace(layout, ep=ep, moe_imbalance=space.moe_imbalance) if ep > 1 else layout
            for layout in layouts for ep in sorted(set(space.eps)) if layout.dp % ep == 0]


def _needs_fsdp(layout: Layout, tp: int) -> bool:
    """Whether ParallelConfig refuses DDP over this layout's data (and context) ranks: tp, or a split backward."""
    return tp > 1 or layout.schedule in SPLIT_BACKWARD_SCHEDULES


def _layouts(num_blocks: int, ranks: int, batch: int, space: SearchSpace, gpus_per_node: int, tp: int,
             sp: bool, cp: int = 1) -> list[Layout]:
    """The layouts of `ranks` = dp * pp pipeline-rank slots, each `tp` GPUs wide (and `cp` of them per slot)."""
    layouts = []
    for pp in range(1, min(num_blocks, space.max_pp or num_blocks, ranks) + 1):
        if ranks % pp or batch % (ranks // pp) or space.only_pp not in (None, pp):
            continue
        dp = ranks // pp
        local = batch // dp
        for schedule in space.schedules:
            multi = schedule in MULTI_STAGE_SCHEDULES
            if pp == 1 and schedule != "gpipe":
                continue  # one stage: every schedule is the same computation
            depths = (2,) if schedule in V_SCHEDULES else space.virtual if multi else (1,)
            for v in depths:
                if pp * v > num_blocks:
                    continue
                for chunks in _chunk_options(local, pp, space):
                    if chunks < min_microbatches(schedule, pp) or (multi and schedule not in V_SCHEDULES
                                                                   and chunks % pp):
                        continue
                    for checkpoint, offload in ((c, o) for c in space.checkpoints for o in space.offload):
                        if checkpoint == "except_last" and chunks == 1:
                            continue  # the last (only) micro-batch does not recompute: same as "never"
                        if offload and (chunks == 1 or checkpoint != "never"):
                            continue  # nothing waits for its backward, or little is kept: offloading moves nothing
                        # "selective": shorthand for always with the selective unit (as `--checkpoint selective`)
                        policy, unit = ("always", "selective") if checkpoint == "selective" else (
                            checkpoint, space.recompute_unit)
                        for mode in space.dp_modes if dp > 1 else ("ddp",):
                            shard = _shard_group(mode, dp, pp, tp, gpus_per_node, cp, space.dp_shard)
                            if mode == "hsdp" and not shard:
                                continue  # HSDP needs shard groups (a node's ranks) and several of them
                            if dp > 1 and mode == "ddp" and schedule in SPLIT_BACKWARD_SCHEDULES:
                                continue  # refused by ParallelConfig: DDP gets such a backward wrong
                            if dp > 1 and mode == "ddp" and tp > 1:
                                continue  # refused by ParallelConfig: tensor parallelism composes with FSDP2
                            for balance, reshard in ((b, r) for b in (space.balances if pp * v > 1 else ("uniform",))
                                                     for r in _reshards(space, mode, dp, pp, schedule)):
                                layouts.append(Layout(dp=dp, pp=pp, batch=batch, chunks=chunks, schedule=schedule,
                                                      virtual=v, checkpoint=policy, dp_mode=mode, balance=balance,
                                                      gpus_per_node=gpus_per_node, tp=tp, sequence_parallel=sp,
                                                      precision=space.precision, float8=space.float8,
                                                      keep_outputs=space.keep_outputs,
                                                      recompute_unit=unit, fsdp_reshard=reshard, offload=offload,
                                                      recompute_every=space.recompute_every if unit != "stage"
                                                      else 1, dp_shard=shard))
    return layouts


def lower_bound_s(blocks: Sequence[BlockCost], layout: Layout, device: Device, network: Network,
                  cache: dict | None = None) -> float:
    """A step time the simulation cannot beat: the average rank's compute, gradient reduction and optimizer.
    `cache`: a dict kept across calls on the same blocks, device and network (the model's sums per size)."""
    samples = context_samples(layout.batch // layout.dp // layout.chunks, layout.cp)
    tp, sp = layout.tp, layout.sequence_parallel
    key = (samples, tp, sp, layout.ep)
    parts = ("parts", layout.ep)
    dense, shares = cache[parts] if cache is not None and parts in cache else rank_parts(blocks, layout.ep)
    if cache is not None:
        cache[parts] = dense, shares
    if cache is None or key not in cache:
        times = [block_times(b, samples, device, tp, sp) for b in blocks]
        comm = sum(tp_comm_s(b, samples, tp, network) for b in blocks)
        sums = (sum(t[0] for t in times), sum(sum(t) for t in times), comm,
                sum(tp_param_bytes(b, tp) for b in dense), sum(b.param_bytes for b in shares))
        if cache is not None:
            cache[key] = sums
    else:
        sums = cache[key]
    forward, total, comm, param_bytes, expert_bytes = sums
    work = total + 2 * comm
    if layout.checkpoint != "never":
        again = layout.chunks if layout.checkpoint == "always" else layout.chunks - 1
        redo = SELECTIVE_RECOMPUTE_SHARE * forward if layout.recompute_unit == "selective" else forward
        work += again / layout.chunks * (redo + comm) / (layout.recompute_every if layout.recompute_unit != "stage"
                                                         else 1)
    actions = 2 * layout.virtual * layout.chunks * device.action_overhead_s + device.step_overhead_s
    grads = layout.gradient_layout()
    shards = grads.shards
    experts = expert_layout(grads)
    expert_shards = experts.dp if layout.dp_mode == "fsdp" else 1
    if cache is None or (shards, tp, layout.ep) not in cache:
        optimizer = optimizer_s(dense, device, shards, tp) + (optimizer_s(shares, device, expert_shards)
                                                               if shares else 0.0)
        if cache is not None:
            cache[shards, tp, layout.ep] = optimizer
    else:
        optimizer = cache[shards, tp, layout.ep]
    reduce = reduce_s(param_bytes, grads, network) + (reduce_s(expert_bytes, experts, network) if shares else 0.0)
    return (layout.chunks * work + reduce + optimizer) / layout.pp + actions


def search(blocks: Sequence[BlockCost], *, gpus: int, batch: int, device: Device, network: Network,
           space: SearchSpace = SearchSpace(), gpus_per_node: int = 0, top: int = 10) -> SearchResult:
    """The `top` fastest layouts of `gpus` ranks that fit `device.memory_bytes` (ConfigError when none)."""
    tps = [(tp, sp) for tp, sp in tp_options(gpus, space, gpus_per_node) if tp_problem(blocks, tp, sp) is None]
    # sequence parallelism dominates (see above), but cp > 1 cuts the sequence without it
    tps = [(tp, sp) for tp, sp in tps if sp or (tp, True) not in tps or max(space.cps) > 1]
    layouts = [layout for layout in enumerate_layouts(len(blocks), gpus, batch, space, gpus_per_node, tps)
               if ep_problem(blocks, layout.ep) is None
               and cp_problem(blocks, layout.cp, layout.cp_attention) is None]
    if not layouts:
        raise ConfigError(_no_layout(len(blocks), gpus, batch), hint=_gpu_hint(len(blocks), gpus, batch))
    cache: dict = {}
    bounded = sorted(((lower_bound_s(blocks, layout, device, network, cache), i) for i, layout in enumerate(layouts)))
    result = SearchResult(best=[], enumerated=len(layouts))
    seen_balance: set[tuple] = set()
    for bound, index in bounded:
        if len(result.best) >= top and bound > result.best[-1].step_s:
            break
        layout = layouts[index]
        prediction = predict(blocks, layout, device, network)
        result.simulated += 1
        if _reshards_to_fit(layout, prediction, space, device):  # "auto" inside a pipeline: only where it must
            prediction = predict(blocks, replace(layout, fsdp_reshard=True), device, network)
            result.simulated += 1
        key = (replace(layout, balance="uniform"), prediction.balance)
        if key in seen_balance:
            continue  # "time" gave the uniform split: the same layout twice
        seen_balance.add(key)
        if max(prediction.memory_bytes) > device.memory_bytes:
            result.too_big.append(prediction)
            continue
        result.best.append(prediction)
        result.best.sort(key=lambda p: p.step_s)
        del result.best[top:]
    if not result.best:
        smallest = min(max(predict(blocks, layout, device, network).memory_bytes) for layout in layouts)
        raise ConfigError(
            f"no layout of {gpus} GPUs fits in {device.memory_bytes / 2**30:.1f} GB per GPU "
            f"(the leanest needs {smallest / 2**30:.2f} GB per GPU)",
            hint=f"pass --gpu-mem {smallest / 2**30:.2f} or more, more GPUs, or a smaller --batch",
        )
    result.too_big.sort(key=lambda p: p.step_s)
    return result


def _shard_group(mode: str, dp: int, pp: int, tp: int, gpus_per_node: int, cp: int = 1,
                 given: int | None = None) -> int:
    """HSDP's shard group in data replicas: `given`, or the replicas of one node (train's rank = ((dp_rank * cp +
    cp_rank) * pp + pp_rank) * tp + tp_rank: a replica's cp ranks beside it), when it shards over several ranks
    (shard · cp) and leaves several groups; 0 otherwise (and for the other modes)."""
    if mode != "hsdp":
        return 0
    if given is None:
        if not gpus_per_node or gpus_per_node % (pp * tp * cp):
            return 0
        given = gpus_per_node // (pp * tp * cp)
    return given if 0 < given < dp and dp % given == 0 and given * cp > 1 else 0


def _reshards(space: SearchSpace, mode: str, dp: int, pp: int, schedule: str) -> tuple[bool, ...]:
    """Whether FSDP reshards after forward in the layouts of this mode, dp, pp and schedule: one or both ways."""
    split = schedule in SPLIT_BACKWARD_SCHEDULES
    if mode not in ("fsdp", "hsdp") or dp == 1 or split and space.fsdp_reshard != "never":
        return (False,)  # resharding is refused under the split-backward schedules (ParallelConfig)
    if space.fsdp_reshard == "both":
        return (False, True)
    return (reshard_after_forward(space.fsdp_reshard, pp=pp) is True,)


def _reshards_to_fit(layout: Layout, prediction: Prediction, space: SearchSpace, device: Device) -> bool:
    """Whether `--fsdp-reshard auto` reshards this FSDP layout in a pipeline: its gathered weights do not fit."""
    if space.fsdp_reshard != "auto" or layout.fsdp_reshard or layout.shards == 1 or layout.dp == 1:
        return False
    if layout.schedule in SPLIT_BACKWARD_SCHEDULES:
        return False
    over = max(prediction.memory_bytes) - device.memory_bytes
    return reshard_after_forward("auto", pp=layout.pp, gathered_bytes=over, budget_bytes=0.0) is True


def _no_layout(num_blocks: int, gpus: int, batch: int) -> str:
    return (f"no layout of {gpus} GPUs: dp x pp must equal {gpus} with pp <= {num_blocks} (the model's blocks) "
            f"and dp dividing the global batch {batch}")


def _gpu_hint(num_blocks: int, gpus: int, batch: int) -> str:
    def works(n: int) -> bool:
        return any(n % pp == 0 and batch % (n // pp) == 0 for pp in range(1, min(num_blocks, n) + 1))

    below = next((n for n in range(gpus - 1, 0, -1) if works(n)), None)
    above = next((n for n in range(gpus + 1, 2 * gpus + 2) if works(n)), None)
    options = " or ".join(str(n) for n in (below, above) if n)
    return f"use {options} GPUs, or a batch divisible by more GPU counts"

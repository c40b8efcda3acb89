"""The layouts the search may try: `SearchSpace` (what may vary) and `enumerate_layouts` (every valid layout of a
GPU count within it, as train's checks accept them).

Tensor parallelism: `SearchSpace.tps` lists the degrees to try (default 1 only); a degree is enumerated only
where it divides the GPUs of a node (so a TP group never leaves its node: ranks are dp × pp × tp with tp
innermost) and the GPU count; `search` keeps only those the model splits into (`tensor.tp_problem`).

Expert parallelism: `SearchSpace.eps` lists the degrees to try for a mixture-of-experts model (default 1 only);
a degree is enumerated where it divides dp (`search` keeps those dividing every MoE block's experts:
`experts.ep_problem`); DualPipeV at ep > 1 each way of `SearchSpace.moe_overlap` (`--moe-overlap`). Context
parallelism: `SearchSpace.cps` lists the degrees that split each sequence (default 1 only); a degree takes its
ranks as train's mesh does (pp · tp apart: its exchange crosses nodes where cp · pp · tp ranks do not fit in one,
plan/context.py).

HSDP (in `dp_modes` by default, beside ddp and fsdp, each with the same resharding options as fsdp): a shard group
is the data replicas of one node with their cp ranks (train's mesh: rank = ((replica · cp + cp rank) · pp + pp
rank) · tp + tp rank), or `SearchSpace.dp_shard` replicas when given; so a job on one node has no HSDP layout
unless `dp_shard` is given. Only the node's group is tried: a smaller one holds more state and all-reduces more
over the inter-node link; a larger one would cross nodes with its gathers (priced on the node's links by
`predict.reduce_s`, so not searched). With HSDP an expert-parallel degree must also divide the shard group (an EP
group lies in one, as ParallelConfig requires; the experts then shard over dp_shard / ep ranks).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipetrain.config import SPLIT_BACKWARD_SCHEDULES
from pipetrain.plan.experts import ep_cp_problem
from pipetrain.plan.layout import Layout
from pipetrain.plan.overlap import can_overlap
from pipetrain.plan.reshard import reshard_after_forward
from pipetrain.plan.schedules import MULTI_STAGE_SCHEDULES, SIMULATED_SCHEDULES, V_SCHEDULES, min_microbatches

__all__ = ["SearchSpace", "enumerate_layouts", "tp_options"]


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """What may vary. `max_chunks` bounds micro-batches per replica; `virtual` the interleaved depths (the
    V schedules always have 2 stages per rank); `tps` the tensor-parallel degrees and `sequence_parallel`
    whether they run with sequence parallelism (False, True or both; tp = 1 has none)."""

    schedules: tuple[str, ...] = SIMULATED_SCHEDULES
    checkpoints: tuple[str, ...] = ("never", "except_last", "always")
    #: data-parallel modes; "hsdp" only where there are shard groups (several nodes, or `dp_shard` given)
    dp_modes: tuple[str, ...] = ("ddp", "fsdp", "hsdp")
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
    #: under selective recomputation, the matrix products a block keeps ("all", "alternate", or both: each selective
    #: layout both ways)
    selective_matmuls: tuple[str, ...] = ("all",)
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
    #: DualPipeV at ep > 1: its fused pairs run in turn (False), overlapped (True: `--moe-overlap on`), or both
    moe_overlap: tuple[bool, ...] = (False,)
    #: context-parallel degrees to try, and the attention they use (`Layout`'s)
    cps: tuple[int, ...] = (1,)
    cp_attention: str = "ring"
    #: HSDP's shard group in data replicas (`--dp-shard`; None: the replicas of one node)
    dp_shard: int | None = None


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
            if cp < 1 or (gpus // tp) % cp:
                continue
            found = _layouts(num_blocks, gpus // tp // cp, batch, space, gpus_per_node, tp, sp, cp)
            if cp > 1:  # the cp ranks reduce gradients as data ranks: FSDP2 under tp or a split backward, as with dp
                found = [replace(lay, dp_mode="fsdp") if lay.dp == 1 and _needs_fsdp(lay, tp) else lay for lay in found
                         if lay.dp_mode != "ddp" or lay.dp == 1 or not _needs_fsdp(lay, tp)]
            layouts += [replace(lay, cp=cp, cp_attention=space.cp_attention) if cp > 1 else lay for lay in found]
    split = [replace(layout, ep=ep, moe_imbalance=space.moe_imbalance) if ep > 1 else layout
             for layout in layouts for ep in sorted(set(space.eps))
             if layout.dp % ep == 0 and (layout.dp_mode != "hsdp" or layout.dp_shard % ep == 0)]
    split = [layout for layout in split if ep_cp_problem(layout) is None]  # ep beside cp: pp 1 and tp 1, as train
    return [replace(layout, moe_overlap=True) if overlap else layout for layout in split
            for overlap in (sorted(set(space.moe_overlap)) if can_overlap(layout) else (False,))]


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
                            products = space.selective_matmuls if unit == "selective" else ("all",)
                            for balance, reshard, matmuls in (
                                    (b, r, m) for b in (space.balances if pp * v > 1 else ("uniform",))
                                    for r in _reshards(space, mode, dp, pp, schedule) for m in products):
                                layouts.append(Layout(dp=dp, pp=pp, batch=batch, chunks=chunks, schedule=schedule,
                                                      virtual=v, checkpoint=policy, dp_mode=mode, balance=balance,
                                                      gpus_per_node=gpus_per_node, tp=tp, sequence_parallel=sp,
                                                      precision=space.precision, float8=space.float8,
                                                      keep_outputs=space.keep_outputs,
                                                      recompute_unit=unit, fsdp_reshard=reshard, offload=offload,
                                                      recompute_every=space.recompute_every if unit != "stage"
                                                      else 1, dp_shard=shard, selective_matmuls=matmuls))
    return layouts


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

"""`--layout auto`: the fastest predicted layout of a job's ranks, batch and memory, within the flags given (pure).

Every layout `pipetrain.plan.search.enumerate_layouts` lists for the world size, narrowed by the fixed choices
(`Fixed`: the flags the user gave), that the engine accepts (`accepts`, e.g. `pipetrain.config`'s rules) is
predicted with `pipetrain.plan.predict.predict`. Of the layouts whose memory per rank fits, those predicted
within `MARGIN` of the fastest are taken as equally fast (the planner's median step-time error is about 10 %),
and the plainest of them is chosen (`plainness`): DDP before FSDP, no recomputation before recomputation, whole
backward passes before split ones, one stage per rank before several — the costs the planner models least well
(FSDP's per-parameter gathers on gloo measured 2.5x slower than DDP where it predicted a tie; the split-backward
schedules measured 1.7-3.9x slower than 1F1B on CPU) are paid only for a predicted gain larger than its error.
Ties are broken by predicted time, then by the order of the enumeration, so the same files give every rank the
same choice. No fit: one ConfigError naming the smallest memory per rank that would.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from pipetrain.config import SPLIT_BACKWARD_SCHEDULES
from pipetrain.errors import ConfigError
from pipetrain.plan.context import context_degrees
from pipetrain.plan.experts import expert_degrees
from pipetrain.plan.hardware import Device, Network
from pipetrain.plan.model import BlockCost
from pipetrain.plan.overlap import can_overlap
from pipetrain.plan.predict import Layout, Prediction, predict
from pipetrain.plan.schedules import SIMULATED_SCHEDULES
from pipetrain.plan.search import SearchSpace, enumerate_layouts

__all__ = ["Fixed", "AutoChoice", "MARGIN", "choose_layout", "layout_flags", "memory_flags", "plainness"]

_MB = 2**20
#: Layouts predicted within this fraction of the fastest count as equally fast (the planner's median error).
MARGIN = 0.10


def plainness(layout: Layout) -> tuple[bool, ...]:
    """Sort key: False first for DDP (or one replica), experts unsplit (no all-to-all), fused pairs in turn (no
    second thread), sequences whole (no context parallelism), no recomputation, a whole backward, one stage per rank,
    then weights kept gathered, whole-stage recomputation, no offloading (the memory modes pay only where they must)."""
    return (layout.dp > 1 and layout.dp_mode != "ddp", layout.ep > 1, layout.moe_overlap, layout.cp > 1,
            layout.checkpoint != "never",
            layout.schedule in SPLIT_BACKWARD_SCHEDULES, layout.virtual > 1, layout.fsdp_reshard,
            layout.recompute_unit != "stage", layout.selective_matmuls != "all", layout.offload)


@dataclass(frozen=True, kw_only=True)
class Fixed:
    """The layout choices the user fixed (None: the search chooses). HSDP is searched where the ranks span nodes
    (a node's ranks shard, the nodes replicate) or `dp_shard` is given."""

    pp: int | None = None
    dp: int | None = None
    dp_mode: str | None = None
    schedule: str | None = None
    chunks: int | None = None
    checkpoint: str | None = None
    virtual: int | None = None
    balance: str | None = None  # "uniform" or "time"
    ep: int | None = None
    cp: int | None = None
    cp_attention: str | None = None
    dp_shard: int | None = None  # HSDP's shard group (`--dp-shard K`): the layout is hsdp with it
    moe_overlap: bool | None = None  # `--moe-overlap on|off`: DualPipeV's fused pairs at ep > 1 overlapped or not

    def allows(self, layout: Layout) -> bool:
        """Whether `layout` keeps every fixed choice (`moe_overlap` binds only the layouts that can overlap)."""
        return all(want is None or getattr(layout, name) == want for name, want in vars(self).items()
                   if (name != "cp_attention" or layout.cp > 1)  # a whole sequence has no cp attention
                   and (name != "moe_overlap" or can_overlap(layout)))

    def space(self, max_chunks: int, offload: bool = False, eps: tuple[int, ...] = (1,),
              cps: tuple[int, ...] = (1,)) -> SearchSpace:
        """The search space these choices leave: with both FSDP (and HSDP) resharding choices, selective
        recomputation, activation offloading where it moves something (`offload`: a GPU), the expert-parallel degrees `eps` (a
        mixture-of-experts model) unless --ep is fixed and the context-parallel ones `cps` unless --cp is."""
        base = SearchSpace()
        return SearchSpace(
            schedules=(self.schedule,) if self.schedule else SIMULATED_SCHEDULES,
            checkpoints=(self.checkpoint,) if self.checkpoint else (*base.checkpoints, "selective"),
            fsdp_reshard="both", offload=(False, True) if offload else (False,),
            selective_matmuls=("all", "alternate"),
            dp_modes=(self.dp_mode,) if self.dp_mode else ("hsdp",) if self.dp_shard else base.dp_modes,
            dp_shard=self.dp_shard,
            balances=(self.balance,) if self.balance else base.balances,
            virtual=(self.virtual,) if self.virtual else base.virtual,
            max_chunks=max(max_chunks, self.chunks or 1), only_pp=self.pp,
            eps=(self.ep,) if self.ep else eps, cps=(self.cp,) if self.cp else cps,
            moe_overlap=(self.moe_overlap,) if self.moe_overlap is not None else (False, True),
            cp_attention=self.cp_attention or "ring")


@dataclass(frozen=True)
class AutoChoice:
    """The chosen prediction, and how many layouts were predicted."""

    prediction: Prediction
    considered: int


def choose_layout(blocks: Sequence[BlockCost], *, world: int, batch: int, device: Device, network: Network,
                  fixed: Fixed = Fixed(), gpus_per_node: int = 0, max_chunks: int = 64,
                  accepts: Callable[[Layout], bool] = lambda layout: True, unit: str = "rank",
                  precision: str = "fp32") -> AutoChoice:
    """The fastest layout of `world` ranks for the global `batch` whose predicted memory per rank fits
    `device.memory_bytes`, among those `fixed` allows and `accepts` takes; `precision` the job's ("bf16": FSDP
    gathers its weights in bf16, see `Layout.precision`)."""
    if fixed.dp_mode == "hsdp" and fixed.dp_shard is None and not gpus_per_node:
        raise ConfigError(f"--layout auto with --dp-mode hsdp: the {world} {unit}s are on one node, so HSDP has no "
                          "node's ranks to shard within", hint="pass --dp-shard K (the ranks of a shard group, a "
                                                               "divisor of dp), or another --dp-mode")
    cps = context_degrees(blocks, world, fixed.cp_attention or "ring")
    space = replace(fixed.space(max_chunks, offload=not device.cores, eps=expert_degrees(blocks, world), cps=cps),
                    precision=precision)
    layouts = [layout for layout in enumerate_layouts(len(blocks), world, batch, space, gpus_per_node)
               if getattr(layout, "tp", 1) == 1 and fixed.allows(layout) and accepts(layout)]  # no TP yet
    if not layouts:
        given = ", ".join(f"{k}={v}" for k, v in vars(fixed).items() if v is not None) or "no constraint"
        raise ConfigError(f"--layout auto: no layout of {world} {unit}s for a global batch of {batch} with "
                          f"{len(blocks)} blocks ({given})",
                          hint="drop or change the layout flags given with --layout auto, the number of ranks, "
                               "or the batch size")
    fitting: list[Prediction] = []
    leanest = float("inf")
    for layout in layouts:
        prediction = predict(blocks, layout, device, network)
        need = max(prediction.memory_bytes)
        leanest = min(leanest, need)
        if need <= device.memory_bytes:
            fitting.append(prediction)
    if not fitting:
        need = math.ceil(leanest / _MB)  # whole MB, rounded up: that much fits
        raise ConfigError(f"--layout auto: no layout of {world} {unit}s fits in {device.memory_bytes / _MB:.0f} MB "
                          f"per {unit} (the leanest of {len(layouts)} needs {need} MB per {unit})",
                          hint=f"give each {unit} {need} MB or more (--mem-cap {need}), more ranks, or a smaller "
                               "batch size")
    fastest = min(p.step_s for p in fitting)
    near = [p for p in fitting if p.step_s <= fastest * (1 + MARGIN)]
    best = min(near, key=lambda p: (plainness(p.layout), p.step_s))  # min keeps the first of equal keys
    return AutoChoice(best, len(layouts))


def layout_flags(prediction: Prediction) -> list[str]:
    """The `pipetrain train` flags of the chosen layout (all of them: the same run without --layout auto)."""
    lay = prediction.layout
    flags = ["--pp", str(lay.pp), "--dp", str(lay.dp), "--dp-mode", lay.dp_mode, "--schedule", lay.schedule,
             "--chunks", str(lay.chunks), "--checkpoint", lay.checkpoint]
    if lay.virtual > 1:
        flags += ["--stages-per-rank", str(lay.virtual)]
    if lay.ep > 1:
        flags += ["--ep", str(lay.ep)]
    if lay.moe_overlap:
        flags += ["--moe-overlap", "on"]
    if lay.cp > 1:
        flags += ["--cp", str(lay.cp), "--cp-attention", lay.cp_attention]
    if lay.pp * lay.virtual > 1:
        flags += ["--balance", ",".join(map(str, prediction.balance))]
    return flags + memory_flags(lay)


def memory_flags(layout: Layout) -> list[str]:
    """The `pipetrain train` flags of `layout`'s memory modes (none for the plain layout)."""
    flags = []
    if layout.recompute_unit != "stage" and layout.checkpoint != "never":
        flags += ["--recompute-unit", layout.recompute_unit]
        if layout.recompute_every > 1:
            flags += ["--recompute-every", str(layout.recompute_every)]
        if layout.selective_matmuls != "all":
            flags += ["--selective-matmuls", layout.selective_matmuls]
    if layout.dp_mode == "hsdp":
        flags += ["--dp-shard", str(layout.dp_shard)]
    if layout.fsdp_reshard and layout.shards > 1 and layout.dp > 1:
        flags += ["--fsdp-reshard", "always"]
    if layout.offload:
        flags.append("--offload-activations")
    return flags

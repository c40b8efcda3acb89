"""Balance by measured cost: stage time and memory predicted from a per-block profile (pure, no torch).

Time of a stage: the sum of its blocks' forward + backward times for one micro-batch (the slowest stage
sets the pace of the pipeline). Memory of a stage (one stage per rank):
`STATE_FACTOR` x parameter bytes (parameters, gradients and AdamW's two moments) plus activation bytes
times the micro-batches whose activations the schedule holds at once on that stage: all `m` for GPipe,
`min(m, p - s)` on stage `s` for 1F1B. Recomputation is not modelled (the prediction is then an upper
bound), nor are communication buffers or the allocator's overhead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipetrain.errors import ConfigError
from pipetrain.partition.profile import ModelProfile
from pipetrain.partition.solver import balance_bounds, solve_balance

__all__ = [
    "COST_METHODS",
    "STATE_FACTOR",
    "StageCost",
    "BalanceChoice",
    "in_flight",
    "stage_costs",
    "balance_by_cost",
    "check_mem_cap",
]

#: Partition methods that need a profile.
COST_METHODS = ("time", "memory")
#: Bytes kept per parameter byte: the parameter, its gradient and AdamW's two moment estimates.
STATE_FACTOR = 4


def in_flight(schedule: str, pp: int, chunks: int, stage: int) -> int:
    """Micro-batches whose activations stage `stage` of a `pp`-stage `schedule` holds at its peak."""
    if schedule == "gpipe":
        return chunks
    if schedule == "1f1b":
        return min(chunks, pp - stage)
    raise ConfigError(
        f"the memory model covers one stage per rank (gpipe, 1f1b), not schedule {schedule!r}",
        hint="use --partition time (or an explicit --balance) with interleaved and zero-bubble schedules",
    )


@dataclass(frozen=True)
class StageCost:
    """Predicted cost of one stage: blocks `[start, stop)`, forward+backward seconds, memory bytes."""

    start: int
    stop: int
    time_s: float
    memory_bytes: int | None


@dataclass(frozen=True)
class BalanceChoice:
    """The balance a cost method chose and what it predicts per stage."""

    method: str
    balance: tuple[int, ...]
    stages: tuple[StageCost, ...]
    mem_cap_bytes: int | None = None

    def lines(self) -> list[str]:
        """What the trainer prints at start: the balance and each stage's predicted cost."""
        cap = "" if self.mem_cap_bytes is None else f" under a cap of {self.mem_cap_bytes / 2**20:.1f} MB per rank"
        lines = [f"balance by measured {self.method}{cap}: {list(self.balance)}"]
        for index, stage in enumerate(self.stages):
            memory = "" if stage.memory_bytes is None else f", memory {stage.memory_bytes / 2**20:.1f} MB"
            lines.append(f"  stage {index}: blocks {stage.start}-{stage.stop - 1}, "
                         f"fwd+bwd {stage.time_s * 1e3:.2f} ms per micro-batch{memory}")
        return lines


def _memory_rows(profile: ModelProfile, schedule: str, pp: int, chunks: int) -> list[list[int]]:
    return [
        [STATE_FACTOR * b.param_bytes + in_flight(schedule, pp, chunks, stage) * b.activation_bytes
         for b in profile.blocks]
        for stage in range(pp)
    ]


def stage_costs(
    profile: ModelProfile, balance: tuple[int, ...] | list[int], *, schedule: str, chunks: int
) -> tuple[StageCost, ...]:
    """Predicted time (and, for one-stage-per-rank schedules, memory) of each stage of `balance`."""
    bounds = balance_bounds(balance)
    if bounds and bounds[-1][1] != profile.num_blocks:
        raise ConfigError(f"balance {list(balance)} covers {bounds[-1][1]} blocks, the profile {profile.num_blocks}",
                          hint="give block counts adding up to the model's blocks")
    rows = _memory_rows(profile, schedule, len(bounds), chunks) if schedule in ("gpipe", "1f1b") else None
    return tuple(
        StageCost(start, stop, sum(b.time_s for b in profile.blocks[start:stop]),
                  None if rows is None else sum(rows[s][start:stop]))
        for s, (start, stop) in enumerate(bounds)
    )


def check_mem_cap(method: str, mem_cap_mb: float | None) -> None:
    """Raise ConfigError unless `method` is a cost method and `mem_cap_mb` (if any) a positive size for "time"."""
    if method not in COST_METHODS:
        raise ConfigError(f"unknown cost method {method!r}", hint=f"choose one of: {', '.join(COST_METHODS)}")
    if mem_cap_mb is not None and (method != "time" or not math.isfinite(mem_cap_mb) or mem_cap_mb <= 0):
        raise ConfigError(f"--mem-cap {mem_cap_mb!r} needs --partition time and a positive size in MB",
                          hint="e.g. --partition time --mem-cap 512")


def balance_by_cost(
    profile: ModelProfile,
    *,
    method: str,
    stages: int,
    schedule: str,
    chunks: int,
    mem_cap_mb: float | None = None,
) -> BalanceChoice:
    """The exact contiguous balance over `stages` stages by measured `method` ("time" or "memory").

    "time" minimises the slowest stage's forward+backward time, under `mem_cap_mb` per stage when given;
    "memory" minimises the largest stage's predicted memory. An infeasible cap raises
    `InfeasibleCapError` naming the smallest cap that fits.
    """
    check_mem_cap(method, mem_cap_mb)
    times = [b.time_s for b in profile.blocks]
    cap = None if mem_cap_mb is None else int(mem_cap_mb * 2**20)
    if method == "memory" or cap is not None:
        rows = _memory_rows(profile, schedule, stages, chunks)
        if method == "memory":
            balance = solve_balance(rows, stages)
        else:
            balance = solve_balance(times, stages, memory=rows, mem_cap=cap)
    else:
        balance = solve_balance(times, stages)
    return BalanceChoice(method, tuple(balance), stage_costs(profile, balance, schedule=schedule, chunks=chunks), cap)

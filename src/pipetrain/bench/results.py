"""Benchmark results: one record per cell, an append-only JSON-lines store, and speed-up computation.

Ideal speed-up (GPipe bubble). Let one stage take time T for the forward+backward of a whole batch and
the model be cut into p equal stages. Naive model parallelism (m = 1) runs the stages one after the
other: p·T. With m micro-batches each stage spends T/m per micro-batch and the pipeline drains after
m + p − 1 slots: (m + p − 1)·T/m. So the ideal speed-up of m chunks over 1 chunk is

    ideal_speedup = p·m / (m + p − 1)          (gpipe and 1f1b: same bubble)

and, for interleaved schedules with v stages per rank, whose bubble shrinks to (p − 1)/v slots,
p·m / (m + (p − 1)/v). It ignores communication and per-micro-batch overheads; it is None for
the schedules that split the backward (zero-bubble, zbv, dualpipev: no closed form, it depends on how the
backward splits into input and weight gradients).
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Collection, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from pipetrain.bench.grid import Cell
from pipetrain.config import SCHEDULES, SPLIT_BACKWARD_SCHEDULES
from pipetrain.errors import ConfigError
from pipetrain.trace.summary import ideal_bubble

__all__ = ["STATUSES", "CellResult", "ResultStore", "ideal_speedup", "compute_speedups"]

STATUSES = ("ok", "oom", "invalid", "error", "timeout")
_FORMAT_VERSION = 1


def ideal_speedup(pp: int, chunks: int, schedule: str = "gpipe") -> float | None:
    """Speed-up of `chunks` micro-batches over naive (1 chunk) on `pp` equal stages, bubble only."""
    if schedule in SPLIT_BACKWARD_SCHEDULES:
        return None
    virtual = SCHEDULES.get(schedule, 1)
    return pp * chunks / (chunks + (pp - 1) / virtual)


def _ideal_bubble(cell: Cell) -> float | None:
    return ideal_bubble(cell.schedule, cell.pp, cell.chunks, SCHEDULES[cell.schedule]) if cell.schedule in SCHEDULES else None


@dataclass(frozen=True, kw_only=True)
class CellResult:
    """What one cell measured. Times are seconds, memory MB (2**20 bytes).

    `median_step_s` is the median of the timed optimizer steps (warm-up excluded) and `step_s_spread`
    their interquartile range (75th − 25th percentile, 0 with fewer than 2 steps). `epoch_s` is
    median step time × steps per epoch of the training set. `peak_mem_mb_per_stage` has one value per
    pipeline rank (see `pipetrain.launch.memory.peak_memory_mb` for what it counts on CPU and CUDA).
    Speed-ups are ratios of median step times (>1 means this cell is faster); None when unavailable.
    `measured_bubble` is the traced bubble fraction averaged over the ranks (see `pipetrain.trace.summary`),
    from steps traced after the timed ones; `ideal_bubble` the schedule's (p-1)/(m+p-1) counterpart.
    """

    cell: Cell
    status: str
    reason: str | None = None
    median_step_s: float | None = None
    step_s_spread: float | None = None
    samples_per_s: float | None = None
    epoch_s: float | None = None
    peak_mem_mb_per_stage: list[float] | None = None
    #: CUDA: the caching allocator's peak reservation per pipeline rank, MB (None on the CPU)
    peak_reserved_mb_per_stage: list[float] | None = None
    speedup_vs_chunks1: float | None = None
    speedup_vs_pp1: float | None = None
    ideal_speedup: float | None = None
    measured_bubble: float | None = None
    ideal_bubble: float | None = None

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ConfigError(f"unknown cell status {self.status!r}", hint=f"use one of: {', '.join(STATUSES)}")

    @property
    def key(self) -> str:
        """The key of the cell."""
        return self.cell.key

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def peak_mem_mb(self) -> float | None:
        """The largest per-stage peak (the rank that runs out first)."""
        return max(self.peak_mem_mb_per_stage) if self.peak_mem_mb_per_stage else None

    @classmethod
    def from_steps(
        cls,
        cell: Cell,
        step_times_s: Sequence[float],
        *,
        steps_per_epoch: int,
        peak_mem_mb_per_stage: Sequence[float],
        measured_bubble: float | None = None,
        peak_reserved_mb_per_stage: Sequence[float] | None = None,
    ) -> CellResult:
        """An "ok" result from the measured step times (warm-up already removed)."""
        if not step_times_s:
            raise ConfigError("no timed step to summarize", hint="time at least one step after warm-up")
        times = sorted(float(t) for t in step_times_s)
        median = statistics.median(times)
        if len(times) >= 2:
            q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
            spread = q3 - q1
        else:
            spread = 0.0
        return cls(
            cell=cell,
            status="ok",
            median_step_s=median,
            step_s_spread=spread,
            samples_per_s=cell.batch_size / median if median > 0 else None,
            epoch_s=median * steps_per_epoch,
            peak_mem_mb_per_stage=[float(m) for m in peak_mem_mb_per_stage],
            peak_reserved_mb_per_stage=(None if peak_reserved_mb_per_stage is None
                                        else [float(m) for m in peak_reserved_mb_per_stage]),
            ideal_speedup=ideal_speedup(cell.pp, cell.chunks, cell.schedule),
            measured_bubble=measured_bubble,
            ideal_bubble=_ideal_bubble(cell),
        )

    @classmethod
    def failed(cls, cell: Cell, status: str, reason: str) -> CellResult:
        """A result for a cell that did not finish ("oom", "invalid", "error" or "timeout")."""
        if status == "ok":
            raise ConfigError("a failed cell cannot have status 'ok'", hint="use CellResult.from_steps")
        return cls(cell=cell, status=status, reason=reason,
                   ideal_speedup=ideal_speedup(cell.pp, cell.chunks, cell.schedule), ideal_bubble=_ideal_bubble(cell))

    def as_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict (the cell nested under "cell")."""
        data = asdict(self)
        data["cell"] = self.cell.as_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CellResult:
        """Inverse of `as_dict`; unknown keys are ignored."""
        fields = {k: v for k, v in data.items() if k in cls.__dataclass_fields__ and k != "cell"}
        return cls(cell=Cell.from_dict(data["cell"]), **fields)


class ResultStore:
    """An append-only JSON-lines file, one finished cell per line, each line flushed and fsynced.

    An interrupted run keeps every finished cell; a half-written last line is ignored by `load`, and
    the next `append` starts on a fresh line. When a key appears twice, the later line wins.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def append(self, result: CellResult) -> None:
        """Write one result durably."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"v": _FORMAT_VERSION, **result.as_dict()}, sort_keys=True)
        with open(self.path, "ab") as fh:
            if fh.tell() > 0 and not self._ends_with_newline():
                fh.write(b"\n")
            fh.write(line.encode() + b"\n")
            fh.flush()
            os.fsync(fh.fileno())

    def _ends_with_newline(self) -> bool:
        with open(self.path, "rb") as fh:
            fh.seek(-1, os.SEEK_END)
            return fh.read(1) == b"\n"

    def load(self) -> dict[str, CellResult]:
        """Every stored result by cell key (lines that do not parse, e.g. a truncated one, are skipped)."""
        if not self.path.exists():
            return {}
        results: dict[str, CellResult] = {}
        with open(self.path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                try:
                    result = CellResult.from_dict(json.loads(line))
                except (ValueError, KeyError, TypeError, ConfigError):
                    continue
                results[result.key] = result
        return results

    def done_keys(self, *, retry: Collection[str] = ()) -> set[str]:
        """Keys of the cells already finished, except those whose status is in `retry` (e.g. {"error"})."""
        return {k for k, r in self.load().items() if r.status not in retry}


def _naive_key(cell: Cell, schedule: str) -> str:
    return replace(cell, chunks=1, schedule=schedule).key


def compute_speedups(results: Iterable[CellResult]) -> list[CellResult]:
    """Fill `speedup_vs_chunks1` and `speedup_vs_pp1` for every "ok" result that has its reference.

    vs chunks 1: the cell with chunks=1 and everything else equal (naive model parallelism); when that
    schedule cannot run one chunk (1f1b with pp > 1), the gpipe chunks=1 cell, which is the same computation.
    vs pp 1: the pp=1, chunks=1, gpipe cell with the same batch, dp, checkpoint, preset and memory limit,
    i.e. plain training of the same batch on one device. References must be "ok"; order is preserved.
    """
    items = list(results)
    ok = {r.key: r for r in items if r.ok and r.median_step_s}
    out = []
    for r in items:
        if not (r.ok and r.median_step_s):
            out.append(r)
            continue
        naive = ok.get(_naive_key(r.cell, r.cell.schedule)) or ok.get(_naive_key(r.cell, "gpipe"))
        single = ok.get(replace(r.cell, pp=1, chunks=1, schedule="gpipe").key)
        out.append(replace(
            r,
            speedup_vs_chunks1=naive.median_step_s / r.median_step_s if naive else None,
            speedup_vs_pp1=single.median_step_s / r.median_step_s if single else None,
        ))
    return out

"""Stragglers: once per `--log-every` window, the compute time of a step on every rank, compared across the
ranks of the same stage position (one pipeline stage, one tensor-parallel rank, all data-parallel replicas).

A rank whose compute time exceeds the median of the others of its position by `--straggler-factor` (default 1.3) is
named, with its host, in the console and in that step's `steps.jsonl` record. A difference under `MIN_EXCESS_S`
is scheduling noise, never named. The rank's time is the least over the last `SAMPLES` steps of the window (a late
wake-up only adds time, to one step; a straggler is slow in each); each is timed the way a trace times it
(`pipeline.timeline.Recorder`: each stage's forward and backward chunks, not the P2P waits). The backward of a
stage's last micro-batch is left out: under DDP it holds the gradient all-reduce, in which a fast replica waits
for the slow one (FSDP's reductions run in their own action, left out too; its parameter all-gathers in forward
are counted). Traced steps (`--trace`) are not measured (one recorder at a time); a window without a measured
step is not compared. A job without data parallelism has nothing to compare.
"""

from __future__ import annotations

import socket
import statistics
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch.distributed as dist

from pipetrain.pipeline.clock import clock_for
from pipetrain.pipeline.timeline import Record, Recorder

__all__ = ["DEFAULT_STRAGGLER_FACTOR", "RankTime", "Straggler", "stragglers", "straggler_line", "compute_seconds",
           "StragglerWatch"]

DEFAULT_STRAGGLER_FACTOR = 1.3
#: Seconds by which a rank must exceed its peers' median to be named (below: the OS's scheduling, not the rank).
MIN_EXCESS_S = 0.01
#: Steps measured at the end of each window (the least of their times is the rank's).
SAMPLES = 3
_COMPUTE = ("F", "B", "I", "W")


@dataclass(frozen=True)
class RankTime:
    """One rank's compute seconds of the measured step, and its place: `position` (pp rank, tp rank), `dp` rank."""

    rank: int
    host: str
    position: tuple[int, int]
    dp: int
    seconds: float


@dataclass(frozen=True)
class Straggler:
    """A rank `ratio` times slower than the `median_s` of the other ranks of its stage position."""

    rank: int
    host: str
    stage: int
    dp: int
    seconds: float
    median_s: float
    ratio: float

    def as_dict(self) -> dict:
        return asdict(self)


def stragglers(times: Sequence[RankTime], factor: float, min_excess_s: float = MIN_EXCESS_S) -> list[Straggler]:
    """The ranks slower than `factor` x the median of the others of their stage position, and by more than
    `min_excess_s` (pure).

    The median of the others, not of the whole group: with two replicas the group's median is their mean, which
    a straggler itself pulls up (a rank 2x slower would stand only 1.33x above it).
    """
    groups: dict[tuple[int, int], list[RankTime]] = {}
    for t in times:
        groups.setdefault(t.position, []).append(t)
    found = []
    for members in groups.values():
        for t in members:
            others = [o.seconds for o in members if o.rank != t.rank]
            if not others:
                continue
            median = statistics.median(others)
            if median > 0 and t.seconds > factor * median and t.seconds - median > min_excess_s:
                found.append(Straggler(t.rank, t.host, t.position[0], t.dp, t.seconds, median, t.seconds / median))
    return sorted(found, key=lambda s: s.rank)


def straggler_line(s: Straggler | dict, step: int, factor: float) -> str:
    """e.g. ``straggler at step 20: rank 3 on node2 (stage 1, replica 1) computed its step in 0.412 s, 2.6x the
    median 0.158 s of stage 1's other replicas (--straggler-factor 1.3)``."""
    s = s if isinstance(s, Straggler) else Straggler(**s)
    return (f"straggler at step {step}: rank {s.rank} on {s.host} (stage {s.stage}, replica {s.dp}) computed its step "
            f"in {s.seconds:.3f} s, {s.ratio:.1f}x the median {s.median_s:.3f} s of stage {s.stage}'s other "
            f"replicas (--straggler-factor {factor:g})")


def compute_seconds(records: Sequence[Record]) -> float:
    """Seconds of compute in one recorded step: its forward and backward chunks, less the backward of each stage's
    last micro-batch (under DDP it waits for the other replicas in the gradient all-reduce)."""
    last: dict[int, int] = {}
    for kind, _, _, _, stage, mb in records:
        if kind in ("B", "I"):
            last[stage] = max(last.get(stage, -1), mb)
    total = sum(end - start for kind, start, end, _, stage, mb in records
                if kind in _COMPUTE and not (kind in ("B", "I") and mb == last.get(stage)))
    return total / 1e9


class StragglerWatch:
    """One rank's part: `measure(step, busy)` around the engine's step, `compare(step)` after it (a collective on
    every rank at the end of each window; rank 0 returns the stragglers, the others an empty list)."""

    def __init__(self, engine, *, every: int, factor: float, dp: int, dp_rank: int, pp_rank: int,
                 tp_rank: int = 0) -> None:
        self.every, self.factor = every, factor
        self.on = dp > 1 and dist.is_initialized() and dist.get_world_size() > 1
        self._recorder = Recorder(clock=clock_for(engine.device)) if self.on else None
        self._place = (pp_rank, tp_rank)
        self._dp_rank = dp_rank
        self._measured: list[float] = []

    def due(self, step: int) -> bool:
        return self.on and step % self.every == 0

    def _sampled(self, step: int) -> bool:
        return self.on and (step % self.every == 0 or self.every - step % self.every < SAMPLES)

    @contextmanager
    def measure(self, step: int, *, busy: bool = False) -> Iterator[None]:
        """Time step `step` (counted from 1) when it is one of the last `SAMPLES` of a window and no trace records
        it (`busy`)."""
        if not self._sampled(step) or busy or self._recorder is None:
            yield
            return
        self._recorder.records.clear()
        with self._recorder.recording(step):
            yield
        self._measured.append(compute_seconds(self._recorder.records))

    def compare(self, step: int) -> list[Straggler]:
        if not self.due(step):
            return []
        mine = (socket.gethostname(), self._place, self._dp_rank,
                min(self._measured) if self._measured else None)
        self._measured = []
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        if dist.get_rank() != 0 or any(g[3] is None for g in gathered):  # every step traced: no comparison
            return []
        return stragglers([RankTime(r, host, tuple(place), dp, seconds)
                           for r, (host, place, dp, seconds) in enumerate(gathered)], self.factor)

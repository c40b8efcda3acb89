"""Spans: what one rank did when, as plain data (no torch), and the kinds a timeline distinguishes."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

__all__ = ["Span", "COMPUTE_KINDS", "TP_KINDS", "CP_KINDS", "KIND_LABELS", "spans_to_dicts", "spans_from_dicts", "union_ns",
           "within_compute"]

#: Work on one micro-batch of one stage: forward, full backward, input-grad backward, weight-grad backward.
COMPUTE_KINDS = ("F", "B", "I", "W")
#: Tensor-parallel collectives (trace/collectives.py), each inside the forward or backward that ran it.
TP_KINDS = ("tp_all_reduce", "tp_all_gather", "tp_reduce_scatter", "tp_all_to_all")
#: Context-parallel exchanges (pipetrain.context), each inside the forward or backward that ran it: one ring step's
#: key/value (or, in backward, gradient) send and receive; one all-to-all of all-to-all attention.
CP_KINDS = ("cp_ring", "cp_all_to_all")
#: Every kind and how reports name it.
KIND_LABELS = {
    "F": "forward",
    "B": "backward",
    "I": "backward (input grad)",
    "W": "backward (weight grad)",
    "wait": "send/recv wait",
    "recompute": "recomputation",
    "dp": "data-parallel collective",
    "optimizer": "optimizer step",
    "metrics": "metrics all-reduce",
    "step": "step",
    "tp_all_reduce": "TP all-reduce",
    "tp_all_gather": "TP all-gather",
    "tp_reduce_scatter": "TP reduce-scatter",
    "tp_all_to_all": "TP all-to-all",
    "cp_ring": "CP ring step",
    "cp_all_to_all": "CP all-to-all",
}


@dataclass(frozen=True)
class Span:
    """One interval on `rank`'s clock (aligned to rank 0's, in ns): `kind` of `KIND_LABELS`.

    `stage` and `microbatch` are set for compute kinds (and recomputation), else -1. `step` counts the
    traced steps from 0.
    """

    rank: int
    kind: str
    start_ns: int
    end_ns: int
    step: int
    stage: int = -1
    microbatch: int = -1

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def name(self) -> str:
        """A short label such as `F3` (forward of micro-batch 3) or `optimizer`."""
        if self.kind in COMPUTE_KINDS:
            return f"{self.kind}{self.microbatch}"
        if self.kind == "recompute":
            return f"R{self.microbatch}"
        return KIND_LABELS.get(self.kind, self.kind)


def spans_to_dicts(spans: Iterable[Span]) -> list[dict]:
    """JSON-ready dicts of `spans`."""
    return [asdict(span) for span in spans]


def spans_from_dicts(items: Iterable[dict]) -> list[Span]:
    """Inverse of `spans_to_dicts`."""
    return [Span(**item) for item in items]


def union_ns(intervals: Sequence[tuple[int, int]]) -> int:
    """Total length of the union of `[start, end)` intervals (overlaps counted once)."""
    total, current_start, current_end = 0, None, None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total


def within_compute(spans: Sequence[Span]) -> list[Span]:
    """`spans` with each TP collective and CP exchange given the stage and micro-batch of the compute span (or
    recomputation) of its rank and step that contains it (a collective outside any, e.g. in a norm clip, keeps -1)."""
    work: dict[tuple[int, int], list[Span]] = {}
    for s in spans:
        if s.kind in COMPUTE_KINDS or s.kind == "recompute":
            work.setdefault((s.rank, s.step), []).append(s)
    out = []
    for s in spans:
        if (s.kind in TP_KINDS or s.kind in CP_KINDS) and s.stage < 0:
            around = [w for w in work.get((s.rank, s.step), ()) if w.start_ns <= s.start_ns and s.end_ns <= w.end_ns]
            if around:
                inner = min(around, key=lambda w: w.duration_ns)  # a recomputation inside its backward
                s = Span(s.rank, s.kind, s.start_ns, s.end_ns, s.step, inner.stage, inner.microbatch)
        out.append(s)
    return out

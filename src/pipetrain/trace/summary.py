"""Per-rank summary of a traced run: busy %, measured bubble %, communication wait %, and the ideal bubble.

Per traced step and rank: busy = time in forward/backward compute (and recomputation) over the step span;
comm wait = time blocked on P2P send/recv over the step span; TP comm = seconds in tensor-parallel
collectives (inside the forwards and backwards, so also part of busy: a TP rank's compute includes them); CP comm
the same for context parallelism's ring steps and all-to-alls; measured bubble = the part of the pipeline
window (first compute start to last compute end over all ranks, in that step) in which the rank computes
nothing, the quantity the ideal bubble (p-1)/(m+p-1) describes. Steps are averaged.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from pipetrain.trace.spans import COMPUTE_KINDS, CP_KINDS, TP_KINDS, Span, union_ns

__all__ = ["RankSummary", "ideal_bubble", "summarize", "summary_lines", "step_spans"]

_WORK = (*COMPUTE_KINDS, "recompute")


def ideal_bubble(schedule: str, pp: int, chunks: int, stages_per_rank: int = 1) -> float:
    """The schedule's ideal bubble fraction: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) with `v`
    stages per rank (interleaved 1F1B; an upper bound for the zero-bubble schedule, which fills part of it).
    V schedules, with equal forward, input-backward and weight-backward times (t each per stage): ZB-V
    idles only (p-1)t per rank (the start-up skew; Qi et al. 2024's zero bubble in steady state), hence
    (p-1)/(6m+p-1); DualPipeV idles (p-1)(F&B+B-3W) = 2(p-1)t per rank (DeepSeek-V3's DualPipe bubble,
    its fused F&B run as F then B), hence (p-1)/(3m+p-1). Both for m >= 2p (the simulator's tests)."""
    if schedule == "zbv":
        return (pp - 1) / (6 * chunks + pp - 1)
    if schedule == "dualpipev":
        return (pp - 1) / (3 * chunks + pp - 1)
    v = stages_per_rank if schedule not in ("gpipe", "1f1b") else 1
    return (pp - 1) / (v * chunks + pp - 1)


@dataclass(frozen=True)
class RankSummary:
    """Averages over the traced steps of one rank (fractions in 0..1, times in seconds)."""

    rank: int
    steps: int
    step_s: float
    busy: float
    bubble: float
    comm_wait: float
    optimizer_s: float
    metrics_s: float
    tp_comm_s: float = 0.0
    tp_collectives: float = 0.0
    cp_comm_s: float = 0.0
    cp_exchanges: float = 0.0


def step_spans(spans: Sequence[Span]) -> dict[tuple[int, int], Span]:
    """The `step` span of each (rank, step)."""
    return {(s.rank, s.step): s for s in spans if s.kind == "step"}


def summarize(spans: Sequence[Span]) -> list[RankSummary]:
    """One summary per rank seen in `spans` (which must include each traced step's `step` span)."""
    steps = step_spans(spans)
    by_step: dict[int, list[Span]] = defaultdict(list)
    for span in spans:
        by_step[span.step].append(span)
    totals: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for step, members in by_step.items():
        work = [s for s in members if s.kind in _WORK]
        if not work:
            continue
        window = (min(s.start_ns for s in work), max(s.end_ns for s in work))
        for rank in sorted({s.rank for s in members}):
            if (rank, step) not in steps:
                continue
            span = steps[(rank, step)].duration_ns or 1
            mine = [(s.start_ns, s.end_ns) for s in work if s.rank == rank]
            busy = union_ns(mine)
            waits = union_ns([(s.start_ns, s.end_ns) for s in members if s.rank == rank and s.kind == "wait"])
            t = totals[rank]
            t["steps"] += 1
            t["step_s"] += span / 1e9
            t["busy"] += busy / span
            t["comm_wait"] += waits / span
            t["bubble"] += 1 - union_ns([(max(a, window[0]), min(b, window[1])) for a, b in mine]) / max(
                window[1] - window[0], 1)
            t["optimizer_s"] += sum(s.duration_ns for s in members if s.rank == rank and s.kind == "optimizer") / 1e9
            t["metrics_s"] += sum(s.duration_ns for s in members if s.rank == rank and s.kind == "metrics") / 1e9
            tp = [(s.start_ns, s.end_ns) for s in members if s.rank == rank and s.kind in TP_KINDS]
            t["tp_comm_s"] += union_ns(tp) / 1e9
            t["tp_collectives"] += len(tp)
            cp = [(s.start_ns, s.end_ns) for s in members if s.rank == rank and s.kind in CP_KINDS]
            t["cp_comm_s"] += union_ns(cp) / 1e9
            t["cp_exchanges"] += len(cp)
    out = []
    for rank in sorted(totals):
        t = totals[rank]
        n = t["steps"]
        out.append(RankSummary(rank=rank, steps=int(n), **{k: t[k] / n for k in
                                                         ("step_s", "busy", "bubble", "comm_wait", "optimizer_s",
                                                          "metrics_s", "tp_comm_s", "tp_collectives", "cp_comm_s",
                                                          "cp_exchanges")}))
    return out


def summary_lines(summaries: Sequence[RankSummary], ideal: float | None) -> list[str]:
    """A table: one line per rank, the ideal bubble beside the measured one (and, when any rank ran
    tensor-parallel collectives or context-parallel exchanges, their milliseconds and count per step)."""
    ideal_text = "n/a" if ideal is None else f"{100 * ideal:.1f}%"
    tp, cp = any(s.tp_collectives for s in summaries), any(s.cp_exchanges for s in summaries)
    lines = [f"{'rank':>4} {'step ms':>8} {'busy':>6} {'bubble':>7} {'ideal':>6} {'comm wait':>9} "
             f"{'optim ms':>8} {'metrics ms':>10}" + (f" {'TP comm ms':>10} {'TP calls':>8}" if tp else "")
             + (f" {'CP comm ms':>10} {'CP calls':>8}" if cp else "")]
    for s in summaries:
        lines.append(f"{s.rank:>4} {s.step_s * 1e3:>8.2f} {100 * s.busy:>5.1f}% {100 * s.bubble:>6.1f}% "
                     f"{ideal_text:>6} {100 * s.comm_wait:>8.1f}% {s.optimizer_s * 1e3:>8.2f} {s.metrics_s * 1e3:>10.2f}"
                     + (f" {s.tp_comm_s * 1e3:>10.2f} {s.tp_collectives:>8.0f}" if tp else "")
                     + (f" {s.cp_comm_s * 1e3:>10.2f} {s.cp_exchanges:>8.0f}" if cp else ""))
    return lines

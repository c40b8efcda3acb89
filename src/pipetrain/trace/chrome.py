"""The Chrome / Perfetto trace JSON of a traced run (plain data in, a JSON-ready dict out).

One process and one thread (track) per rank; every span becomes a complete ("X") event in microseconds
from the earliest span. Spans nest on a rank's track (a step contains its forwards, backwards, waits).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pipetrain.trace.spans import KIND_LABELS, Span

__all__ = ["chrome_trace", "spans_from_chrome_trace"]


def chrome_trace(spans: Sequence[Span], *, metadata: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The `{"traceEvents": [...]}` document Perfetto's UI and chrome://tracing open."""
    origin = min((s.start_ns for s in spans), default=0)
    events: list[dict[str, Any]] = []
    for rank in sorted({s.rank for s in spans}):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": rank, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": rank, "args": {"sort_index": rank}})
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": rank, "args": {"name": f"rank {rank}"}})
    # longer spans first at equal start, so viewers nest the inner ones under them
    for s in sorted(spans, key=lambda s: (s.rank, s.start_ns, -s.end_ns)):
        args: dict[str, Any] = {"step": s.step, "what": KIND_LABELS.get(s.kind, s.kind)}
        if s.stage >= 0:
            args["stage"] = s.stage
        if s.microbatch >= 0:
            args["microbatch"] = s.microbatch
        events.append({
            "ph": "X", "name": s.name, "cat": s.kind, "pid": s.rank, "tid": s.rank,
            "ts": (s.start_ns - origin) / 1e3, "dur": s.duration_ns / 1e3, "args": args,
        })
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": dict(metadata or {})}


def spans_from_chrome_trace(doc: Mapping[str, Any]) -> list[Span]:
    """The spans back from a document written by `chrome_trace` (times relative to its earliest span)."""
    spans = []
    for event in doc["traceEvents"]:
        if event.get("ph") != "X":
            continue
        args = event.get("args", {})
        start = round(event["ts"] * 1e3)
        spans.append(Span(event["pid"], event["cat"], start, start + round(event["dur"] * 1e3), args["step"],
                          args.get("stage", -1), args.get("microbatch", -1)))
    return spans

"""Writing a traced run's files: trace.json (Chrome/Perfetto), gantt.png and summary.{txt,json} (no torch)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipetrain.errors import ConfigError
from pipetrain.trace.chrome import chrome_trace
from pipetrain.trace.gantt import write_gantt
from pipetrain.trace.spans import Span
from pipetrain.trace.summary import RankSummary, summarize, summary_lines

__all__ = ["TraceFiles", "check_trace_dir", "write_trace_files", "trace_result"]


@dataclass(frozen=True)
class TraceFiles:
    """A traced run's per-rank summary and where its files are (None when no files were asked for)."""

    trace: Path | None
    gantt: Path | None
    summary: Path | None
    summaries: tuple[RankSummary, ...]
    ideal_bubble: float | None

    def lines(self) -> list[str]:
        return summary_lines(self.summaries, self.ideal_bubble)

    @property
    def mean_bubble(self) -> float | None:
        """The measured bubble averaged over the ranks."""
        return sum(s.bubble for s in self.summaries) / len(self.summaries) if self.summaries else None


def trace_result(spans: Sequence[Span], *, ideal_bubble: float | None = None) -> TraceFiles:
    """The summary of `spans` without writing any file."""
    return TraceFiles(None, None, None, tuple(summarize(spans)), ideal_bubble)


def check_trace_dir(path: Path) -> None:
    """Raise ConfigError now (before any training) if `path` cannot be created or written."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"cannot write the trace folder {str(path)!r}: {err.strerror or err}",
                          hint="pass --trace with a folder you can write to") from None


def _atomic_text(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    os.replace(partial, path)


def write_trace_files(
    spans: Sequence[Span], out_dir: Path, *, ideal_bubble: float | None = None, title: str = "",
    metadata: Mapping[str, Any] | None = None,
) -> TraceFiles:
    """Write the trace JSON, the Gantt PNG of the first traced step and the summary into `out_dir`."""
    check_trace_dir(out_dir)
    summaries = tuple(summarize(spans))
    trace = out_dir / "trace.json"
    _atomic_text(trace, json.dumps(chrome_trace(spans, metadata=metadata)))
    gantt = write_gantt(spans, out_dir / "gantt.png", title=title)
    files = TraceFiles(trace, gantt, out_dir / "summary.txt", summaries, ideal_bubble)
    _atomic_text(files.summary, "\n".join([title, *files.lines()]) + "\n")
    _atomic_text(out_dir / "summary.json", json.dumps({
        "title": title, "ideal_bubble": ideal_bubble, "metadata": dict(metadata or {}),
        "ranks": [asdict(s) for s in summaries],
    }, indent=2) + "\n")
    return files

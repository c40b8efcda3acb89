"""Bench reports: CSV and JSON of every cell, a markdown table laid out like the IDRIS Pipe benchmark's, heatmap PNGs, a summary.

Tables and heatmaps have one block per (pp, schedule, checkpoint, dp) group — plus preset and memory
limit when those vary — with rows = global batch size and columns = chunks. A cell that ran out of
memory reads "OOM", an invalid combination "—", a failure "err" or "timeout"; a cell not run is blank.
Groups where every cell is invalid (e.g. pp=1 with 1f1b) are counted in the markdown but not drawn.
The environment dict (see `collect_environment`) is written to the JSON and the markdown; its optional
key ``"data"`` (e.g. ``"synthetic"``) is shown in titles so synthetic timings are not mistaken for IMDB.
Figures use matplotlib's object API with the Agg canvas, so no global backend is touched.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from pipetrain.bench.environment import collect_environment
from pipetrain.bench.grouping import fmt_time, group_cells, group_label, group_of, limit_note, memory_title
from pipetrain.bench.heatmap import draw_heatmap
from pipetrain.bench.results import CellResult, compute_speedups

__all__ = ["write_reports", "collect_environment", "summary_lines", "markdown_report", "CSV_COLUMNS"]

CSV_COLUMNS = (
    "key", "preset", "mem_limit_mb", "pp", "dp", "schedule", "checkpoint", "batch_size", "chunks",
    "status", "reason", "median_step_s", "step_s_spread", "samples_per_s", "epoch_s", "peak_mem_mb",
    "peak_mem_mb_per_stage", "peak_reserved_mb_per_stage", "speedup_vs_chunks1", "speedup_vs_pp1", "ideal_speedup",
    "measured_bubble", "ideal_bubble",
)
_SHORT = {"oom": "OOM", "invalid": "—", "error": "err", "timeout": "timeout"}
_WORD = {"ok": "ok", "oom": "OOM", "invalid": "invalid", "error": "error", "timeout": "timeout"}


def _cell_text(r: CellResult | None) -> str:
    if r is None:
        return ""
    if not r.ok:
        return _SHORT[r.status]
    mem = f" / {r.peak_mem_mb:.0f} MB" if r.peak_mem_mb is not None else ""
    bubble = ""
    if r.measured_bubble is not None and r.cell.pp > 1:
        ideal = f" (ideal {100 * r.ideal_bubble:.0f}%)" if r.ideal_bubble is not None else ""
        bubble = f" / bubble {100 * r.measured_bubble:.0f}%{ideal}"
    return f"{fmt_time(r.median_step_s or 0.0)} s{mem}{bubble}"


def summary_lines(results: Iterable[CellResult]) -> list[str]:
    """Per (group, batch): the best chunk count and its gain over naive (chunks=1, see `compute_speedups`)."""
    results = compute_speedups(results)
    by_key = {r.key: r for r in results}
    grouped = group_cells(results)
    lines = []
    for group, cells in grouped.items():
        head = group_label(group, grouped, short=True)
        for batch in sorted({b for b, _ in cells}):
            row = {c: r for (b, c), r in cells.items() if b == batch}
            ok = {c: r for c, r in row.items() if r.ok and r.median_step_s}
            prefix = f"{head} batch={batch}: "
            if not ok:
                failed = ", ".join(f"chunks={c} {_WORD[r.status]}" for c, r in sorted(row.items()))
                lines.append(prefix + f"no cell finished ({failed})")
                continue
            best = min(ok, key=lambda c: ok[c].median_step_s or 0.0)
            t_best = ok[best].median_step_s or 0.0
            naive = row.get(1)
            if naive is None or naive.status == "invalid":  # e.g. 1f1b: naive is the gpipe chunks=1 cell
                naive = by_key.get(replace(ok[best].cell, chunks=1, schedule="gpipe").key, naive)
            gain = ok[best].speedup_vs_chunks1
            if best == 1 and all(r.status == "invalid" for c, r in row.items() if c != 1):  # e.g. pp=1
                lines.append(prefix + f"{fmt_time(t_best)} s/step at chunks=1, the only valid chunk count here")
            elif best == 1:
                lines.append(prefix + f"best chunks=1 (naive, {fmt_time(t_best)} s/step); micro-batching did not help")
            elif gain is not None:
                lines.append(prefix + f"best chunks={best}, {gain:.2g}x faster than naive (chunks=1)")
            elif naive is not None and naive.status == "oom":
                lines.append(prefix + f"naive (chunks=1) ran out of memory; chunks={min(ok)} is the smallest that "
                             f"fits; best chunks={best} ({fmt_time(t_best)} s/step)")
            else:
                lines.append(prefix + f"best chunks={best} ({fmt_time(t_best)} s/step); no naive result to compare")
    return lines


def markdown_report(results: Sequence[CellResult], environment: dict[str, Any]) -> str:
    """The markdown text: environment, one "time / memory" table per group, legend and summary."""
    results = compute_speedups(results)
    grouped = group_cells(results)
    out = ["# pipetrain bench", ""]
    out += [f"- **{k}**: {v}" for k, v in environment.items()]
    out += ["", f"Each cell: median step time (s) / {memory_title(environment)} / measured bubble "
                "(share of the pipeline window a rank computes nothing, from traced steps after the timed ones; "
                "ideal (p-1)/(m+p-1) in brackets).",
            "OOM = out of memory, — = invalid combination, err = error, timeout = over the time limit, "
            "blank = not run."]
    limit = limit_note(results, environment)
    if limit:
        out.append(limit[0].upper() + limit[1:] + ".")
    hidden = sum(1 for r in results if group_of(r) not in grouped)
    if hidden:
        out.append(f"{hidden} cells of groups with no valid combination are not shown (see results.csv).")
    out.append("")
    for group, cells in grouped.items():
        chunks = sorted({c for _, c in cells})
        batches = sorted({b for b, _ in cells})
        out += [f"## {group_label(group, grouped)}", ""]
        out.append("| batch \\ chunks | " + " | ".join(str(c) for c in chunks) + " |")
        out.append("|---:|" + "---:|" * len(chunks))
        for b in batches:
            out.append(f"| {b} | " + " | ".join(_cell_text(cells.get((b, c))) for c in chunks) + " |")
        out.append("")
    out += ["## Summary", ""] + [f"- {line}" for line in summary_lines(results)] + [""]
    return "\n".join(out)


def _csv_row(r: CellResult) -> dict[str, Any]:
    row: dict[str, Any] = {"key": r.key, **r.cell.as_dict(), **r.as_dict()}
    row["peak_mem_mb"] = r.peak_mem_mb
    row["peak_mem_mb_per_stage"] = ";".join(f"{m:.1f}" for m in r.peak_mem_mb_per_stage or [])
    row["peak_reserved_mb_per_stage"] = ";".join(f"{m:.1f}" for m in r.peak_reserved_mb_per_stage or [])
    return {k: ("" if row.get(k) is None else row[k]) for k in CSV_COLUMNS}


def write_reports(results: Iterable[CellResult], out_dir: Path, *, environment: dict[str, Any]) -> list[Path]:
    """Write results.csv, results.json, results.md and the heatmap PNGs into `out_dir`; return the paths.

    The bubble heatmap is drawn only when some cell has a measured bubble."""
    results = compute_speedups(results)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "results.csv", out_dir / "results.json", out_dir / "results.md"]
    with open(paths[0], "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(_csv_row(r) for r in results)
    doc = {"environment": environment, "summary": summary_lines(results), "results": [r.as_dict() for r in results]}
    paths[1].write_text(json.dumps(doc, indent=2, default=str) + "\n", encoding="utf-8")
    paths[2].write_text(markdown_report(results, environment), encoding="utf-8")
    grouped = group_cells(results)
    panels = {group_label(g, grouped): cells for g, cells in grouped.items()}
    note = "preset " + ",".join(sorted({r.cell.preset for r in results}))
    limit = limit_note(results, environment)
    metrics = ["step_time", "peak_memory", "speedup"]
    if any(r.measured_bubble is not None and r.cell.pp > 1 for r in results):
        metrics.append("bubble")
    for metric in metrics:
        path = out_dir / f"heatmap_{metric}.png"
        draw_heatmap(panels, metric, path, environment, note, limit)
        paths.append(path)
    return paths

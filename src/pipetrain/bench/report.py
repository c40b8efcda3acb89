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
import datetime as _dt
import json
import os
import platform
import shlex
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from pipetrain.bench.results import CellResult, compute_speedups
from pipetrain.config import CHECKPOINT_POLICIES, SCHEDULES

__all__ = ["write_reports", "collect_environment", "summary_lines", "markdown_report", "CSV_COLUMNS"]

CSV_COLUMNS = (
    "key", "preset", "mem_limit_mb", "pp", "dp", "schedule", "checkpoint", "batch_size", "chunks",
    "status", "reason", "median_step_s", "step_s_spread", "samples_per_s", "epoch_s", "peak_mem_mb",
    "peak_mem_mb_per_stage", "peak_reserved_mb_per_stage", "speedup_vs_chunks1", "speedup_vs_pp1", "ideal_speedup",
    "measured_bubble", "ideal_bubble",
)
_SHORT = {"oom": "OOM", "invalid": "—", "error": "err", "timeout": "timeout"}
_WORD = {"ok": "ok", "oom": "OOM", "invalid": "invalid", "error": "error", "timeout": "timeout"}
_GROUP_FIELDS = ("preset", "mem_limit_mb", "pp", "dp", "tp", "schedule", "checkpoint")
Group = tuple[Any, ...]


def _group_of(r: CellResult) -> Group:
    c = r.cell
    return (c.preset, c.mem_limit_mb, c.pp, c.dp, c.tp, c.schedule, c.checkpoint)


def _group_sort(g: Group) -> tuple[Any, ...]:
    preset, mem, pp, dp, tp, schedule, checkpoint = g
    return (preset, mem is not None, mem or 0, pp, dp, tp, list(SCHEDULES).index(schedule),
            CHECKPOINT_POLICIES.index(checkpoint))


def _grouped(results: Sequence[CellResult]) -> dict[Group, dict[tuple[int, int], CellResult]]:
    """Results by group then (batch, chunks); groups whose cells are all invalid are left out."""
    groups: dict[Group, dict[tuple[int, int], CellResult]] = {}
    for r in results:
        groups.setdefault(_group_of(r), {})[(r.cell.batch_size, r.cell.chunks)] = r
    shown = [g for g, cells in groups.items() if any(r.status != "invalid" for r in cells.values())]
    return {g: groups[g] for g in sorted(shown, key=_group_sort)}


def _label(group: Group, groups: Iterable[Group], *, short: bool = False) -> str:
    """"pp=2, schedule=gpipe, checkpoint=never": pp always, schedule and checkpoint unless `short`,
    the others (and in short form all) only when they vary across groups; dp also when > 1."""
    groups = list(groups)
    parts = []
    for i, name in enumerate(_GROUP_FIELDS):
        shown = (
            name == "pp"
            or len({g[i] for g in groups}) > 1
            or (name in ("dp", "tp") and group[i] != 1)
            or (name in ("schedule", "checkpoint") and not short)
        )
        if shown:
            parts.append(f"{'mem' if name == 'mem_limit_mb' else name}={group[i]}")
    return " ".join(parts) if short else ", ".join(parts)


def _fmt_time(t: float) -> str:
    return f"{t:.1f}" if t >= 10 else f"{t:.3g}"


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
    return f"{_fmt_time(r.median_step_s or 0.0)} s{mem}{bubble}"


def summary_lines(results: Iterable[CellResult]) -> list[str]:
    """Per (group, batch): the best chunk count and its gain over naive (chunks=1, see `compute_speedups`)."""
    results = compute_speedups(results)
    by_key = {r.key: r for r in results}
    grouped = _grouped(results)
    lines = []
    for group, cells in grouped.items():
        head = _label(group, grouped, short=True)
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
                lines.append(prefix + f"{_fmt_time(t_best)} s/step at chunks=1, the only valid chunk count here")
            elif best == 1:
                lines.append(prefix + f"best chunks=1 (naive, {_fmt_time(t_best)} s/step); micro-batching did not help")
            elif gain is not None:
                lines.append(prefix + f"best chunks={best}, {gain:.2g}x faster than naive (chunks=1)")
            elif naive is not None and naive.status == "oom":
                lines.append(prefix + f"naive (chunks=1) ran out of memory; chunks={min(ok)} is the smallest that "
                             f"fits; best chunks={best} ({_fmt_time(t_best)} s/step)")
            else:
                lines.append(prefix + f"best chunks={best} ({_fmt_time(t_best)} s/step); no naive result to compare")
    return lines


def _memory_title(environment: dict[str, Any]) -> str:
    if str(environment.get("device", "cpu")).startswith("cuda"):
        return "peak allocated GPU memory (MB, max over stages)"
    return "peak RSS of a rank process (MB, max over ranks; interpreter and torch included)"


def _limit_note(results: Iterable[CellResult], environment: dict[str, Any]) -> str | None:
    """What the memory limit of the cells was and what it counts, or None when no cell had one."""
    limits = sorted({r.cell.mem_limit_mb for r in results if r.cell.mem_limit_mb is not None})
    if not limits:
        return None
    what = ("a cap on the caching allocator" if str(environment.get("device", "cpu")).startswith("cuda")
            else "allocated memory (RLIMIT_DATA) above the rank process's size at start, so not the RSS shown")
    return f"memory limit {', '.join(map(str, limits))} MB per rank: {what}"


def markdown_report(results: Sequence[CellResult], environment: dict[str, Any]) -> str:
    """The markdown text: environment, one "time / memory" table per group, legend and summary."""
    results = compute_speedups(results)
    grouped = _grouped(results)
    out = ["# pipetrain bench", ""]
    out += [f"- **{k}**: {v}" for k, v in environment.items()]
    out += ["", f"Each cell: median step time (s) / {_memory_title(environment)} / measured bubble "
                "(share of the pipeline window a rank computes nothing, from traced steps after the timed ones; "
                "ideal (p-1)/(m+p-1) in brackets).",
            "OOM = out of memory, — = invalid combination, err = error, timeout = over the time limit, "
            "blank = not run."]
    limit = _limit_note(results, environment)
    if limit:
        out.append(limit[0].upper() + limit[1:] + ".")
    hidden = sum(1 for r in results if _group_of(r) not in grouped)
    if hidden:
        out.append(f"{hidden} cells of groups with no valid combination are not shown (see results.csv).")
    out.append("")
    for group, cells in grouped.items():
        chunks = sorted({c for _, c in cells})
        batches = sorted({b for b, _ in cells})
        out += [f"## {_label(group, grouped)}", ""]
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
    grouped = _grouped(results)
    panels = {_label(g, grouped): cells for g, cells in grouped.items()}
    note = "preset " + ",".join(sorted({r.cell.preset for r in results}))
    limit = _limit_note(results, environment)
    metrics = ["step_time", "peak_memory", "speedup"]
    if any(r.measured_bubble is not None and r.cell.pp > 1 for r in results):
        metrics.append("bubble")
    for metric in metrics:
        path = out_dir / f"heatmap_{metric}.png"
        _draw_heatmap(panels, metric, path, environment, note, limit)
        paths.append(path)
    return paths


_METRICS = {  # metric -> (title, colormap, value getter); "lower is better" maps are yellow-to-red
    "step_time": ("Median step time (s)", "YlOrRd", lambda r: r.median_step_s),
    "peak_memory": ("", "YlOrRd", lambda r: r.peak_mem_mb),
    "speedup": ("Speed-up over naive model parallelism (chunks=1, same pp and batch)", "RdYlGn",
                lambda r: r.speedup_vs_chunks1),
    "bubble": ("Measured bubble (% of the pipeline window a rank computes nothing; ideal in brackets)", "YlOrRd",
               lambda r: r.measured_bubble if r.cell.pp > 1 else None),
}


_FAILED_STYLE = {  # status -> (face colour, hatch, text) of a cell without a value
    "oom": ("#b8b8b8", "///", "OOM"),
    "invalid": ("#f2f2f2", "", "invalid"),
    "error": ("#d8d8d8", "xx", "err"),
    "timeout": ("#d8d8d8", "xx", "timeout"),
}


def _ratio_ticks(span: float) -> list[float]:
    """Colour-bar ticks for ratios in [1/span, span]: powers of two, or finer steps for a narrow range."""
    steps = [2.0**k for k in range(-8, 9)] if span >= 4 else [0.5, 2 / 3, 0.8, 1 / 1.1, 1.0, 1.1, 1.25, 1.5, 2.0]
    return [t for t in steps if 0.9999 / span <= t <= 1.0001 * span]


def _draw_heatmap(panels: dict[str, dict[tuple[int, int], CellResult]], metric: str, path: Path,
                  environment: dict[str, Any], note: str, limit: str | None = None) -> None:
    """One subplot per group, rows = batch, columns = chunks, values written in the cells; `limit` is
    the memory-limit note, a line of the title when given."""
    import matplotlib
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import LogNorm, Normalize
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    title, cmap_name, value = _METRICS[metric]
    if not title:
        memory = _memory_title(environment)
        title = memory[0].upper() + memory[1:]
    values = [v for cells in panels.values() for r in cells.values() if r.ok and (v := value(r)) is not None]
    vmin, vmax = (min(values), max(values)) if values else (0.0, 1.0)
    if metric == "speedup":  # a ratio: 0.5x is as far from 1 as 2x, so the colours are log-symmetric around 1
        span = max(vmax, 1 / vmin if vmin > 0 else 1.0, 1.1)
        norm: Normalize = LogNorm(vmin=1 / span, vmax=span)
    else:
        norm = Normalize(vmin=vmin, vmax=vmax if vmax > vmin else vmin + 1)
    cmap = matplotlib.colormaps[cmap_name].with_extremes(bad="white")

    n = max(1, len(panels))
    ncols = min(n, 3)
    nrows = -(-n // ncols)
    shapes = [(len({b for b, _ in c}), len({k for _, k in c})) for c in panels.values()] or [(1, 1)]
    width = max(1.1 * max(s[1] for s in shapes) + 1.6, 4.5)
    height = 0.6 * max(s[0] for s in shapes) + 1.6
    fig = Figure(figsize=(width * ncols + 1.2, height * nrows + 1.2), layout="constrained")
    FigureCanvasAgg(fig)
    image = None
    for i, (label, cells) in enumerate(panels.items()):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        batches, chunks = sorted({b for b, _ in cells}), sorted({c for _, c in cells})
        grid = np.full((len(batches), len(chunks)), np.nan)
        for (b, c), r in cells.items():
            v = value(r) if r.ok else None
            if v is not None:
                grid[batches.index(b), chunks.index(c)] = v
        image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, norm=norm, aspect="auto")
        for (b, c), r in cells.items():
            y, x = batches.index(b), chunks.index(c)
            v = value(r) if r.ok else None
            if v is not None:
                red, green, blue, _ = cmap(norm(v))
                dark = 0.299 * red + 0.587 * green + 0.114 * blue < 0.5
                text = f"{v:.2f}x" if metric == "speedup" else (f"{v:.0f}" if metric == "peak_memory" else _fmt_time(v))
                if metric == "bubble":
                    text = f"{100 * v:.0f}%" + (f"\n({100 * r.ideal_bubble:.0f}%)" if r.ideal_bubble is not None else "")
                ax.text(x, y, text, ha="center", va="center", fontsize=9, color="white" if dark else "black")
                continue
            if r.ok:  # finished, but this metric has no value (e.g. no naive reference to compare with)
                ax.text(x, y, "n/a", ha="center", va="center", fontsize=8, color="#707070")
                continue
            face, hatch, text = _FAILED_STYLE[r.status]
            ax.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, facecolor=face, edgecolor="#707070",
                                   hatch=hatch, linewidth=0.5))
            ax.text(x, y, text, ha="center", va="center", fontsize=9, fontweight="bold",
                    color="black" if hatch else "#606060",
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.0} if hatch else None)
        ax.set_xticks(range(len(chunks)), [str(c) for c in chunks])
        ax.set_yticks(range(len(batches)), [str(b) for b in batches])
        ax.set_xlabel("chunks (micro-batches; 1 = naive)")
        ax.set_ylabel("global batch size")
        ax.set_title(label, fontsize=10)
    if image is not None:
        bar = fig.colorbar(image, ax=fig.axes, shrink=0.9, label=title.split(" (")[0])
        if metric == "speedup":
            bar.ax.minorticks_off()
            bar.set_ticks(_ratio_ticks(span), labels=[f"{t:.3g}x" for t in _ratio_ticks(span)])
    device = f"{environment.get('device', '?')} ({environment.get('device_name', 'unknown')})"
    notes = [f"device: {device}", note]
    if environment.get("data"):
        notes.append(f"{environment['data']} data")
    if environment.get("torch"):
        notes.append(f"torch {environment['torch']}")
    fig.suptitle("\n".join([title, ", ".join(notes)] + ([limit] if limit else [])), fontsize=11)
    fig.supxlabel("OOM (hatched) = out of memory; invalid = combination that cannot run; "
                  "err / timeout = failed; n/a = no value; blank = not run", fontsize=8, color="#505050")
    fig.savefig(path, dpi=110)


def _git_revision() -> str:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else "unknown"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def collect_environment(command: list[str], *, device: str | None = None) -> dict[str, Any]:
    """Torch version, device (and its name), CPU count, platform, git revision, date and command line."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else _cpu_name()
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "device_name": name,
        "cpu_count": os.cpu_count(),
        "usable_cpus": affinity,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_revision": _git_revision(),
        "command": shlex.join(command),
    }

"""Heatmap PNGs of a bench grid: one subplot per group, rows = batch, columns = chunks, values written in the cells;
failed cells hatched. matplotlib's object API with the Agg canvas, so no global backend is touched."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipetrain.bench.grouping import fmt_time, memory_title
from pipetrain.bench.results import CellResult

__all__ = ["draw_heatmap"]

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


def draw_heatmap(panels: dict[str, dict[tuple[int, int], CellResult]], metric: str, path: Path,
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
        memory = memory_title(environment)
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
                text = f"{v:.2f}x" if metric == "speedup" else (f"{v:.0f}" if metric == "peak_memory" else fmt_time(v))
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

"""The Gantt chart of a traced run as a PNG, in the style of the IDRIS pipeline page's figure (no torch).

A row per rank; a box per micro-batch's forward (plain) and backward (hatched), coloured by micro-batch
and labelled `F3` / `B3` where they fit; tensor-parallel collectives as dark bands in the lower part of the
box that ran them, context-parallel exchanges (ring steps, all-to-alls) as mid-grey bands in its upper part; send/recv waits as thin grey bars; optimizer step and metrics
as light grey boxes; white is idle. Dotted lines separate traced steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pipetrain.trace.spans import COMPUTE_KINDS, CP_KINDS, TP_KINDS, Span

__all__ = ["write_gantt"]

_HATCH = {"F": None, "B": "//", "I": "//", "W": "xx"}


def write_gantt(spans: Sequence[Span], path: Path, *, title: str = "", max_steps: int | None = 1) -> Path:
    """Draw the first `max_steps` traced steps (all when None) of `spans` to `path` (PNG)."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    chosen = [s for s in spans if max_steps is None or s.step < max_steps]
    ranks = sorted({s.rank for s in chosen})
    origin = min((s.start_ns for s in chosen), default=0)
    end = max((s.end_ns for s in chosen), default=1)
    micro = sorted({s.microbatch for s in chosen if s.kind in COMPUTE_KINDS})
    cmap = matplotlib.colormaps["tab20" if len(micro) > 10 else "tab10"]
    fig = Figure(figsize=(min(24, 10 + 0.25 * len(micro) * max(1, len(ranks))), 1.3 + 0.8 * len(ranks)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    span_ms = (end - origin) / 1e6
    for row, rank in enumerate(ranks):
        y = len(ranks) - 1 - row
        for s in (s for s in chosen if s.rank == rank):
            x, w = (s.start_ns - origin) / 1e6, s.duration_ns / 1e6
            if s.kind in COMPUTE_KINDS or s.kind == "recompute":
                colour = cmap(micro.index(s.microbatch) % cmap.N) if s.microbatch in micro else "0.5"
                ax.broken_barh([(x, w)], (y - 0.4, 0.8), facecolors=colour, edgecolor="black", linewidth=0.5,
                               hatch=_HATCH.get(s.kind, ".."))
                if w > span_ms / 60:
                    ax.text(x + w / 2, y, s.name, ha="center", va="center", fontsize=7)
            elif s.kind in TP_KINDS:  # inside its forward/backward box: a dark band across its lower half
                ax.broken_barh([(x, w)], (y - 0.4, 0.3), facecolors="0.15", zorder=3)  # over its compute box
            elif s.kind in CP_KINDS:  # a ring step's or all-to-all's exchange: a band across the box's upper part
                ax.broken_barh([(x, w)], (y + 0.1, 0.3), facecolors="0.45", zorder=3)
            elif s.kind == "wait":
                ax.broken_barh([(x, w)], (y - 0.08, 0.16), facecolors="0.35")
            elif s.kind in ("optimizer", "metrics", "dp"):
                ax.broken_barh([(x, w)], (y - 0.4, 0.8), facecolors="0.85", edgecolor="0.5", linewidth=0.5)
            elif s.kind == "step" and rank == ranks[0]:
                ax.axvline(x, color="0.6", linestyle=":", linewidth=0.8)
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r}" for r in reversed(ranks)])
    ax.set_xlim(0, span_ms * 1.01)
    ax.set_ylim(-0.6, len(ranks) - 0.4)
    ax.set_xlabel("time (ms)\nF = forward, B = backward (hatched; I/W = input/weight grad), R = recompute, "
                  "grey bar = send/recv wait,\ndark band = TP collective, upper grey band = CP exchange, "
                  "light grey = optimizer/metrics, white = idle", fontsize=7)
    ax.set_title(title or "pipeline timeline")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path

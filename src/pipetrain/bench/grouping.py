"""How a bench grid's cells group for its reports: one block per (pp, schedule, checkpoint, dp) group, plus preset
and memory limit when those vary, rows = global batch size, columns = chunks; the labels, times and memory notes
the tables and heatmaps share."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from pipetrain.bench.results import CellResult
from pipetrain.config import CHECKPOINT_POLICIES, SCHEDULES

__all__ = ["Group", "GROUP_FIELDS", "group_of", "group_cells", "group_label", "fmt_time", "memory_title",
           "limit_note"]

GROUP_FIELDS = ("preset", "mem_limit_mb", "pp", "dp", "tp", "schedule", "checkpoint")
Group = tuple[Any, ...]


def group_of(r: CellResult) -> Group:
    """The group of a cell: its values of `GROUP_FIELDS`."""
    c = r.cell
    return (c.preset, c.mem_limit_mb, c.pp, c.dp, c.tp, c.schedule, c.checkpoint)


def _group_sort(g: Group) -> tuple[Any, ...]:
    preset, mem, pp, dp, tp, schedule, checkpoint = g
    return (preset, mem is not None, mem or 0, pp, dp, tp, list(SCHEDULES).index(schedule),
            CHECKPOINT_POLICIES.index(checkpoint))


def group_cells(results: Sequence[CellResult]) -> dict[Group, dict[tuple[int, int], CellResult]]:
    """Results by group then (batch, chunks); groups whose cells are all invalid are left out."""
    groups: dict[Group, dict[tuple[int, int], CellResult]] = {}
    for r in results:
        groups.setdefault(group_of(r), {})[(r.cell.batch_size, r.cell.chunks)] = r
    shown = [g for g, cells in groups.items() if any(r.status != "invalid" for r in cells.values())]
    return {g: groups[g] for g in sorted(shown, key=_group_sort)}


def group_label(group: Group, groups: Iterable[Group], *, short: bool = False) -> str:
    """"pp=2, schedule=gpipe, checkpoint=never": pp always, schedule and checkpoint unless `short`,
    the others (and in short form all) only when they vary across groups; dp also when > 1."""
    groups = list(groups)
    parts = []
    for i, name in enumerate(GROUP_FIELDS):
        shown = (
            name == "pp"
            or len({g[i] for g in groups}) > 1
            or (name in ("dp", "tp") and group[i] != 1)
            or (name in ("schedule", "checkpoint") and not short)
        )
        if shown:
            parts.append(f"{'mem' if name == 'mem_limit_mb' else name}={group[i]}")
    return " ".join(parts) if short else ", ".join(parts)


def fmt_time(t: float) -> str:
    """Seconds with one decimal from 10 s up, else 3 significant digits."""
    return f"{t:.1f}" if t >= 10 else f"{t:.3g}"


def memory_title(environment: dict[str, Any]) -> str:
    """What the memory figures of a run on this environment's device measure."""
    if str(environment.get("device", "cpu")).startswith("cuda"):
        return "peak allocated GPU memory (MB, max over stages)"
    return "peak RSS of a rank process (MB, max over ranks; interpreter and torch included)"


def limit_note(results: Iterable[CellResult], environment: dict[str, Any]) -> str | None:
    """What the memory limit of the cells was and what it counts, or None when no cell had one."""
    limits = sorted({r.cell.mem_limit_mb for r in results if r.cell.mem_limit_mb is not None})
    if not limits:
        return None
    what = ("a cap on the caching allocator" if str(environment.get("device", "cpu")).startswith("cuda")
            else "allocated memory (RLIMIT_DATA) above the rank process's size at start, so not the RSS shown")
    return f"memory limit {', '.join(map(str, limits))} MB per rank: {what}"

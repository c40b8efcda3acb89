"""Slurm's compact notations, parsed: host lists (``node[01-04,07]``) and tasks per node (``2(x3),1``)."""

from __future__ import annotations

import re

from pipetrain.errors import LaunchError

__all__ = ["expand_nodelist", "expand_tasks_per_node"]

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")  # one entry inside brackets: "07" or "01-04"
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_TASKS = re.compile(r"(\d+)(?:\(x(\d+)\))?")  # "2" or "2(x3)"


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm host list such as ``node[01-04,07]`` or ``a[1-2],b3`` into host names, padding kept."""
    text = nodelist.strip()
    if not text:
        raise LaunchError("empty Slurm node list", hint="check SLURM_JOB_NODELIST, e.g. node[01-04]")
    hosts: list[str] = []
    for item in _split_top_level(text, nodelist):
        names = [""]
        rest = item
        while rest:
            start = rest.find("[")
            if start < 0:
                names = [n + rest for n in names]
                break
            end = rest.find("]", start)  # brackets were checked balanced and flat by _split_top_level
            suffixes = _expand_ranges(rest[start + 1 : end], nodelist)
            names = [n + rest[:start] + s for n in names for s in suffixes]
            rest = rest[end + 1 :]
        bad = next((n for n in names if not _HOST.fullmatch(n)), None)
        if bad is not None:
            raise _bad_nodelist(nodelist, f"{bad!r} is not a host name")
        hosts.extend(names)
    return hosts


def expand_tasks_per_node(spec: str) -> list[int]:
    """Expand Slurm's tasks-per-node notation, e.g. ``2(x3),1`` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for item in spec.strip().split(","):
        match = _TASKS.fullmatch(item.strip())
        if match is None:
            raise LaunchError(
                f"cannot read Slurm tasks per node {spec!r}", hint="expected a form like '4' or '2(x3),1'"
            )
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def _split_top_level(text: str, original: str) -> list[str]:
    items, depth, current = [], 0, []
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth < 0 or depth > 1:
            raise _bad_nodelist(original, "unbalanced brackets")
        if char == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth:
        raise _bad_nodelist(original, "unbalanced '['")
    items.append("".join(current))
    if any(not item.strip() or item != item.strip() for item in items):
        raise _bad_nodelist(original, "empty entry or stray space")
    return items


def _expand_ranges(body: str, original: str) -> list[str]:
    out: list[str] = []
    for part in body.split(","):
        match = _RANGE.fullmatch(part)
        if match is None:
            raise _bad_nodelist(original, f"bad range {part!r}")
        first, last = match.group(1), match.group(2) or match.group(1)
        if int(last) < int(first):
            raise _bad_nodelist(original, f"range {part!r} goes backwards")
        out.extend(str(i).zfill(len(first)) for i in range(int(first), int(last) + 1))
    return out


def _bad_nodelist(nodelist: str, why: str) -> LaunchError:
    return LaunchError(
        f"malformed Slurm node list {nodelist!r}: {why}", hint="expected a form like node[01-04,07],gpu3"
    )

"""The benchmark grid: cells (one training configuration each), axis parsing, expansion and validity checks.

A cell is one point of the Pipe benchmark: `pp` pipeline ranks, `dp` replicas, a *global* batch size, a
number of micro-batches (`chunks`, 1 is naive model parallelism), a schedule, a checkpoint policy, a
workload preset and an optional memory limit. `pp=1` is the single-rank baseline: the whole model on one
device, no pipeline, so the schedule means nothing there and only `gpipe` with chunks=1 is accepted
(other schedules, or micro-batches that would only accumulate gradients on one rank, would be duplicates of
the same computation; `cell_problem` reports them as invalid rather than running them).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pipetrain.config import CHECKPOINT_POLICIES, SCHEDULES, ParallelConfig, PipelineConfig
from pipetrain.errors import ConfigError

__all__ = [
    "AXES",
    "Cell",
    "GridSpec",
    "expand_grid",
    "parse_axis",
    "cell_problem",
    "default_axes",
]

#: Axis name -> Cell field, in expansion order (outermost first; the last axis varies fastest).
AXES: dict[str, str] = {
    "preset": "preset",
    "mem": "mem_limit_mb",
    "pp": "pp",
    "dp": "dp",
    "tp": "tp",
    "schedule": "schedule",
    "checkpoint": "checkpoint",
    "batch": "batch_size",
    "chunks": "chunks",
}
_ALIASES = {"batch_size": "batch", "mem_limit_mb": "mem", "n_microbatches": "chunks"}
_INT_AXES = ("pp", "dp", "tp", "batch", "chunks")
_PRESET_RE = re.compile(r"^[A-Za-z0-9./~][A-Za-z0-9_./~:-]*$")  # PRESET, WORKLOAD:PRESET or path/file.py:NAME:PRESET


@dataclass(frozen=True, kw_only=True)
class Cell:
    """One benchmark configuration. `batch_size` is the global batch (split over `dp` replicas); `tp` ranks split
    each stage's layers (tensor parallelism; with dp > 1 the replicas are FSDP2 shards)."""

    pp: int = 1
    dp: int = 1
    batch_size: int
    chunks: int = 1
    schedule: str = "gpipe"
    checkpoint: str = "never"
    preset: str = "cpu"
    mem_limit_mb: int | None = None
    tp: int = 1

    @property
    def key(self) -> str:
        """A stable identifier of this cell (used to resume an interrupted bench; tp only when > 1, so the keys
        of earlier results stay valid)."""
        mem = "none" if self.mem_limit_mb is None else str(self.mem_limit_mb)
        tp = f",tp={self.tp}" if self.tp > 1 else ""
        return (
            f"preset={self.preset},mem={mem},pp={self.pp},dp={self.dp}{tp},schedule={self.schedule},"
            f"checkpoint={self.checkpoint},batch={self.batch_size},chunks={self.chunks}"
        )

    @property
    def world_size(self) -> int:
        """Ranks this cell needs: dp * pp * tp."""
        return self.dp * self.pp * self.tp

    @property
    def dp_mode(self) -> str:
        """DDP replicas, FSDP2 shards when tensor parallelism composes with dp (the pairing pipetrain supports)."""
        return "fsdp" if self.tp > 1 and self.dp > 1 else "ddp"

    def as_dict(self) -> dict[str, Any]:
        """The fields as a plain JSON-friendly dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Cell:
        """Inverse of `as_dict` (unknown keys are ignored so older/newer files still load)."""
        names = set(AXES.values())
        return cls(**{k: v for k, v in data.items() if k in names})


def _bad_value(axis: str, text: str, why: str, hint: str) -> ConfigError:
    return ConfigError(f"bad value {text!r} for bench axis {axis!r}: {why}", hint=hint)


def _canonical_axis(name: str) -> str:
    axis = _ALIASES.get(name.strip(), name.strip())
    if axis not in AXES:
        raise ConfigError(
            f"unknown bench axis {name!r}",
            hint=f"valid axes: {', '.join(AXES)} (e.g. batch=32,64 chunks=1,4)",
        )
    return axis


def _convert(axis: str, value: Any) -> Any:
    """Validate one axis value (a string from the CLI or an already typed value) and return it typed."""
    text = str(value).strip()
    if axis in _INT_AXES or axis == "mem":
        if axis == "mem" and (value is None or text.lower() == "none"):
            return None
        if isinstance(value, bool) or not re.fullmatch(r"\d+", text) or int(text) < 1:
            raise _bad_value(axis, text, "expected a positive integer", f"e.g. {axis}=1,2,4")
        return int(text)
    if axis == "schedule":
        if text not in SCHEDULES:
            raise _bad_value(axis, text, "unknown schedule", f"choose among: {', '.join(SCHEDULES)}")
        return text
    if axis == "checkpoint":
        if text not in CHECKPOINT_POLICIES:
            raise _bad_value(axis, text, "unknown policy", f"choose among: {', '.join(CHECKPOINT_POLICIES)}")
        return text
    if not _PRESET_RE.match(text):
        raise _bad_value(axis, text, "not a preset name", "e.g. preset=tiny or preset=cpu,gpu or preset=lm:cpu")
    return text


def _axis_values(axis: str, values: Sequence[Any]) -> list[Any]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        values = [values]
    typed = [_convert(axis, v) for v in values]
    if not typed:
        raise ConfigError(f"bench axis {axis!r} has no values, so the grid is empty", hint=f"e.g. {axis}=1,2")
    return list(dict.fromkeys(typed))  # drop duplicates, keep the given order


def parse_axis(text: str) -> tuple[str, list[Any]]:
    """Parse one CLI axis such as ``batch=32,64,128`` into ``("batch", [32, 64, 128])``."""
    name, sep, rest = text.partition("=")
    if not sep or not name.strip():
        raise ConfigError(
            f"cannot read bench axis {text!r}",
            hint=f"write NAME=V1,V2,... with NAME one of: {', '.join(AXES)}",
        )
    axis = _canonical_axis(name)
    parts = [p.strip() for p in rest.split(",") if p.strip()]
    return axis, _axis_values(axis, parts)


@dataclass(frozen=True)
class GridSpec:
    """A set of axes (name -> values); missing axes take the Cell defaults, `batch` is required."""

    axes: dict[str, list[Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        normalized = {}
        for name, values in self.axes.items():
            axis = _canonical_axis(name)
            normalized[axis] = _axis_values(axis, values)
        object.__setattr__(self, "axes", normalized)

    def with_overrides(self, texts: Sequence[str]) -> GridSpec:
        """A copy where each CLI string (``chunks=1,4``) replaces that axis."""
        axes = dict(self.axes)
        for text in texts:
            axis, values = parse_axis(text)
            axes[axis] = values
        return GridSpec(axes)

    def cells(self) -> list[Cell]:
        """The cartesian product of the axes, in stable order."""
        return expand_grid(self.axes)


def expand_grid(axes: Mapping[str, Sequence[Any]]) -> list[Cell]:
    """Every combination of the axes, ordered preset, mem, pp, dp, tp, schedule, checkpoint, batch, chunks."""
    spec = GridSpec(dict(axes)).axes
    if "batch" not in spec:
        raise ConfigError("the bench grid has no batch axis, so it is empty", hint="pass e.g. batch=32,64")
    names = [a for a in AXES if a in spec]
    return [
        Cell(**{AXES[a]: v for a, v in zip(names, combo)})
        for combo in itertools.product(*(spec[a] for a in names))
    ]


def cell_problem(cell: Cell, *, max_ranks: int | None = None) -> str | None:
    """Why this cell cannot run (a one-line reason), or None when it is valid.

    The rules are those of `PipelineConfig` / `ParallelConfig` (built here and their ConfigError caught),
    plus the bench's own: `pp=1` runs only with `gpipe` (see the module docstring), and `max_ranks`
    (devices or processes available), when given, bounds dp * pp.
    """
    if cell.pp == 1 and cell.schedule != "gpipe":
        return f"pp=1 is the single-rank baseline; schedule {cell.schedule!r} only applies to pp >= 2"
    if cell.pp == 1 and cell.chunks != 1:
        return "pp=1 is the single-rank baseline, measured with chunks=1 (micro-batches on one rank only accumulate)"
    if max_ranks is not None and cell.world_size > max_ranks:
        return f"{'dp*pp*tp' if cell.tp > 1 else 'dp*pp'} = {cell.world_size} ranks but only {max_ranks} available"
    try:
        pipeline = PipelineConfig(
            pp=cell.pp, schedule=cell.schedule, n_microbatches=cell.chunks, checkpoint=cell.checkpoint
        )
        ParallelConfig(dp=cell.dp, pipeline=pipeline, tp=cell.tp, dp_mode=cell.dp_mode).check_global_batch(cell.batch_size)
    except ConfigError as exc:
        return exc.message
    return None


def default_axes(device: str, quick: bool = False) -> dict[str, list[Any]]:
    """The grid `pipetrain bench` runs when no axis is given.

    CPU: pp 1,2 x batch 32..256 x chunks 1..16, preset "cpu". GPU: the Pipe benchmark's grid (pp 2,4, same batches
    and chunks, preset "gpu") with checkpoint ``except_last``, the default of the `Pipe` the IDRIS pages measured
    (its memory gain came from it). `quick` (any device): pp 1,2 x batch 32,128 x chunks 1,4, preset "cpu":
    large enough that compute, not communication, fills a step, so micro-batching beats naive model
    parallelism as in the Pipe benchmark (the `tiny` model's 15-40 ms steps are dominated by P2P and per-step costs).
    """
    if quick:
        return {"preset": ["cpu"], "pp": [1, 2], "schedule": ["gpipe"], "checkpoint": ["never"],
                "batch": [32, 128], "chunks": [1, 4]}
    batches, chunks = [32, 64, 128, 256], [1, 2, 4, 8, 16]
    if device.startswith("cuda"):
        return {"preset": ["gpu"], "pp": [2, 4], "schedule": ["gpipe"], "checkpoint": ["except_last"],
                "batch": batches, "chunks": chunks}
    if device != "cpu":
        raise ConfigError(f"unknown bench device {device!r}", hint="use 'cpu' or 'cuda'")
    return {"preset": ["cpu"], "pp": [1, 2], "schedule": ["gpipe"], "checkpoint": ["never"],
            "batch": batches, "chunks": chunks}

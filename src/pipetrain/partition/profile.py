"""The per-block profile format (`pipetrain-profile/2`, reads `/1`): plain dataclasses and their JSON file, no torch.

A profile holds, for one model and one micro-batch size on one device, each block's median forward and
backward time, parameter bytes, activation bytes kept for backward and output bytes. `pipetrain profile`
writes it (see `pipetrain.partition.measure`); the balance solver and the planner read it.

Format 2 adds a fit over several measured micro-batch sizes (`sizes`): each block's time (and activation
bytes) is a fixed cost per micro-batch plus a cost per sample, `*_fixed_*` holding the fixed part and the
plain fields the fitted value at `micro_batch_size`. A format-1 file (one size) loads with fixed parts 0,
which is the old linear rescaling; a profile of one size is still written as format 1.

Either format may hold each block's `selective_bytes`: what the block keeps for backward under selective
recomputation (its input and its matrix products' and attention's outputs, `pipetrain.partition.measure`), and
its `backward_bytes`: the most its backward holds at once beyond its saved activations; absent or null in older
files: unknown.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from pipetrain.errors import ConfigError

__all__ = [
    "PROFILE_FORMAT",
    "PROFILE_FORMAT_FITTED",
    "BlockProfile",
    "ModelProfile",
    "fingerprint_of",
    "load_profile",
    "save_profile",
    "profile_from_dict",
    "profile_to_dict",
]

#: The `format` field of a version-1 profile file (one micro-batch size).
PROFILE_FORMAT = "pipetrain-profile/1"
#: The `format` field of a profile fitted over several micro-batch sizes.
PROFILE_FORMAT_FITTED = "pipetrain-profile/2"

#: One parameter as the fingerprint sees it: (name, shape, dtype name).
ParamDescription = tuple[str, Sequence[int], str]


@dataclass(frozen=True, kw_only=True)
class BlockProfile:
    """Measured costs of block `index` for one micro-batch (times are medians in seconds)."""

    index: int
    name: str
    forward_s: float
    backward_s: float
    param_bytes: int
    activation_bytes: int
    output_bytes: int
    #: the fixed part of each cost per micro-batch (a fitted profile; 0: proportional to the samples)
    forward_fixed_s: float = 0.0
    backward_fixed_s: float = 0.0
    activation_fixed_bytes: int = 0
    #: what selective recomputation keeps of it (the block's input, its matrix products' and attention's outputs;
    #: None: not measured), and its fixed part per micro-batch (a fitted profile)
    selective_bytes: int | None = None
    selective_fixed_bytes: int = 0
    #: the most bytes its backward holds at once beyond its saved activations (the gradients it computes, its
    #: parameters' gradients already there; None: not measured), and its fixed part (a fitted profile)
    backward_bytes: int | None = None
    backward_fixed_bytes: int = 0

    @property
    def time_s(self) -> float:
        """Forward plus backward time of one micro-batch."""
        return self.forward_s + self.backward_s

    def at(self, ratio: float) -> BlockProfile:
        """This block at `ratio` times the samples: the per-sample parts scaled, the fixed parts kept."""
        def scale(value: float, fixed: float) -> float:
            return fixed + (value - fixed) * ratio

        def optional(value: int | None, fixed: int) -> int | None:
            return None if value is None else round(scale(value, fixed))

        return replace(self, forward_s=scale(self.forward_s, self.forward_fixed_s),
                       selective_bytes=optional(self.selective_bytes, self.selective_fixed_bytes),
                       backward_bytes=optional(self.backward_bytes, self.backward_fixed_bytes),
                       backward_s=scale(self.backward_s, self.backward_fixed_s),
                       activation_bytes=round(scale(self.activation_bytes, self.activation_fixed_bytes)),
                       output_bytes=round(self.output_bytes * ratio))


@dataclass(frozen=True, kw_only=True)
class ModelProfile:
    """Per-block costs of one model (identified by `fingerprint`) at one micro-batch size on one device."""

    model: str
    fingerprint: str
    micro_batch_size: int
    device: str
    dtype: str
    repeats: int
    blocks: tuple[BlockProfile, ...]
    #: the micro-batch sizes measured and fitted (format 2); () for one size, `micro_batch_size`
    sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for position, block in enumerate(self.blocks):
            if block.index != position:
                raise ConfigError(
                    f"profile block at position {position} has index {block.index}",
                    hint="blocks must be listed in order with indices 0, 1, 2, ...",
                )

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def fitted(self) -> bool:
        """Whether the costs are fitted over several micro-batch sizes (fixed + per-sample)."""
        return len(self.sizes) > 1

    def describe(self) -> str:
        """How the costs scale, for messages: the sizes fitted, or the one size rescaled linearly."""
        if self.fitted:
            return (f"fitted over micro-batch sizes {', '.join(map(str, self.sizes))} "
                    "(fixed + per-sample costs)")
        return f"measured at micro-batch {self.micro_batch_size}, times rescaled linearly"

    def check_matches(self, *, fingerprint: str, micro_batch_size: int, source: str = "the profile") -> None:
        """Raise ConfigError unless this profile is of the model `fingerprint` at `micro_batch_size`."""
        if self.fingerprint != fingerprint:
            raise ConfigError(
                f"{source} is of another model ({self.model!r}, {self.num_blocks} blocks, fingerprint "
                f"{self.fingerprint[:12]}...; this model's is {fingerprint[:12]}...)",
                hint="profile this model with `pipetrain profile` (same workload, preset and block sizes)",
            )
        if self.micro_batch_size != micro_batch_size:
            raise ConfigError(
                f"{source} was measured at micro-batch size {self.micro_batch_size}, this run uses "
                f"{micro_batch_size}",
                hint=f"profile again with --micro-batch-size {micro_batch_size} (batch size / chunks)",
            )

    def rescaled(self, micro_batch_size: int) -> ModelProfile:
        """An estimate at another micro-batch size: the per-sample parts of times and activation bytes and
        the output bytes scaled linearly, the fixed parts (a fitted profile) kept.

        Parameter bytes are unchanged. A one-size profile has no fixed parts and times do not truly scale
        linearly (small micro-batches run less efficiently), so callers must say they rescaled.
        """
        if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise ConfigError(f"micro-batch size must be >= 1, got {micro_batch_size!r}", hint="pass >= 1")
        ratio = micro_batch_size / self.micro_batch_size
        blocks = tuple(block.at(ratio) for block in self.blocks)
        return replace(self, micro_batch_size=micro_batch_size, blocks=blocks)


def fingerprint_of(blocks: Iterable[tuple[str, Iterable[ParamDescription]]]) -> str:
    """SHA-256 hex of each block's class name and its parameters' names, shapes and dtypes, in order."""
    digest = hashlib.sha256()
    for class_name, params in blocks:
        digest.update(f"block:{class_name}\n".encode())
        for name, shape, dtype in params:
            digest.update(f"{name}:{','.join(str(int(d)) for d in shape)}:{dtype}\n".encode())
    return digest.hexdigest()


def profile_to_dict(profile: ModelProfile) -> dict[str, Any]:
    """The JSON-ready dictionary of `profile`: format 2 when fitted over several sizes, else format 1 (which
    older pipetrain versions read)."""
    data = asdict(profile)
    data["blocks"] = [asdict(block) for block in profile.blocks]
    for block in data["blocks"]:
        for key in ("selective", "backward"):
            if block[f"{key}_bytes"] is None:  # not measured: written as before
                del block[f"{key}_bytes"], block[f"{key}_fixed_bytes"]
    if not profile.fitted:
        del data["sizes"]
        for block in data["blocks"]:
            for key in _FIT_FIELDS:
                block.pop(key, None)
        return {"format": PROFILE_FORMAT, **data}
    data["sizes"] = list(profile.sizes)
    return {"format": PROFILE_FORMAT_FITTED, **data}


_FIT_FIELDS = ("forward_fixed_s", "backward_fixed_s", "activation_fixed_bytes", "selective_fixed_bytes",
               "backward_fixed_bytes")
#: fields a file may leave out or set to null (measured by newer versions only; the fixed parts only when fitted)
_OPTIONAL = ("selective_bytes", "selective_fixed_bytes", "backward_bytes", "backward_fixed_bytes")


def _field(data: dict[str, Any], key: str, kind: type, where: str) -> Any:
    if key not in data:
        raise ValueError(f"{where} has no {key!r}")
    value = data[key]
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
        return float(value) if ok else _bad(where, key, value, "a finite number >= 0")
    if kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        return value if ok else _bad(where, key, value, "a whole number >= 0")
    return value if isinstance(value, str) else _bad(where, key, value, "a string")


def _bad(where: str, key: str, value: Any, expected: str) -> Any:
    raise ValueError(f"{where} has {key}={value!r}, expected {expected}")


def profile_from_dict(data: Any) -> ModelProfile:
    """Parse a format-1 or format-2 dictionary; raises ValueError naming the first bad field."""
    if not isinstance(data, dict):
        raise ValueError("the top level is not a JSON object")
    if data.get("format") not in (PROFILE_FORMAT, PROFILE_FORMAT_FITTED):
        raise ValueError(f"format is {data.get('format')!r}, expected {PROFILE_FORMAT!r} or {PROFILE_FORMAT_FITTED!r}")
    fitted = data["format"] == PROFILE_FORMAT_FITTED
    blocks_data = data.get("blocks")
    if not isinstance(blocks_data, list) or not blocks_data:
        raise ValueError("'blocks' is not a non-empty list")
    kinds = {f.name: f.type for f in fields(BlockProfile)
             if (fitted or f.name not in _FIT_FIELDS) and f.name not in _OPTIONAL}
    blocks = []
    for position, item in enumerate(blocks_data):
        if not isinstance(item, dict):
            raise ValueError(f"block {position} is not a JSON object")
        where = f"block {position}"
        values = {key: _field(item, key, {"int": int, "float": float, "str": str}[kind], where)
                  for key, kind in kinds.items()}
        values.update({key: _field(item, key, int, where) for key in _OPTIONAL if item.get(key) is not None
                       and (fitted or key not in _FIT_FIELDS)})
        blocks.append(BlockProfile(**values))
    micro_batch_size = _field(data, "micro_batch_size", int, "the profile")
    repeats = _field(data, "repeats", int, "the profile")
    if micro_batch_size < 1 or repeats < 1:
        raise ValueError("micro_batch_size and repeats must be >= 1")
    sizes: tuple[int, ...] = ()
    if fitted:
        listed = data.get("sizes")
        if (not isinstance(listed, list) or len(listed) < 2
                or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in listed)):
            raise ValueError(f"sizes={listed!r}, expected a list of two or more micro-batch sizes >= 1")
        sizes = tuple(listed)
    try:
        return ModelProfile(
            model=_field(data, "model", str, "the profile"),
            fingerprint=_field(data, "fingerprint", str, "the profile"),
            micro_batch_size=micro_batch_size,
            device=_field(data, "device", str, "the profile"),
            dtype=_field(data, "dtype", str, "the profile"),
            repeats=repeats,
            blocks=tuple(blocks),
            sizes=sizes,
        )
    except ConfigError as err:
        raise ValueError(err.message) from None


def save_profile(profile: ModelProfile, path: str | os.PathLike[str]) -> None:
    """Write `profile` as JSON to `path` atomically (a temporary file renamed into place)."""
    target = Path(path)
    text = json.dumps(profile_to_dict(profile), indent=2) + "\n"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(
            "w", dir=target.parent, prefix=f".{target.name}.", suffix=".tmp", delete=False
        ) as handle:
            handle.write(text)
        os.replace(handle.name, target)
    except OSError as err:
        raise ConfigError(
            f"cannot write the profile to {str(target)!r}: {err.strerror or err}",
            hint="choose a writable path for --output",
        ) from None


def load_profile(path: str | os.PathLike[str]) -> ModelProfile:
    """Read a profile file; raises ConfigError if it is missing, not JSON, or not format 1 or 2."""
    source = Path(path)
    try:
        text = source.read_text()
    except OSError as err:
        raise ConfigError(
            f"cannot read the profile {str(source)!r}: {err.strerror or err}",
            hint="write one with `pipetrain profile --output FILE`",
        ) from None
    try:
        return profile_from_dict(json.loads(text))
    except (ValueError, TypeError) as err:
        raise ConfigError(
            f"{str(source)!r} is not a valid pipetrain profile file: {err}",
            hint="write it again with `pipetrain profile --output FILE`",
        ) from None

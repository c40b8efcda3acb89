"""Checkpoint folders on disk: names, the commit marker, the latest complete one, and pruning (no torch)."""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipetrain.errors import ConfigError

__all__ = [
    "FORMAT",
    "META_FILE",
    "CheckpointMeta",
    "partial_folder",
    "final_folder",
    "complete_checkpoints",
    "latest_checkpoint",
    "damaged_hint",
    "read_meta",
    "write_meta",
    "commit",
    "prune",
    "probe_writable",
]

FORMAT = "pipetrain-checkpoint/1"
#: Written last, inside the folder, before the commit rename: a folder without it is not a checkpoint.
META_FILE = "pipetrain.json"
_COMPLETE = re.compile(r"step-(\d{8})")
_PARTIAL_SUFFIX = ".partial"
#: A committed checkpoint being replaced by a new save of the same step: `step-NNNNNNNN.replaced-XXXXXXXX`.
_REPLACED = re.compile(r"(step-\d{8})\.replaced-[0-9a-f]{8}")


@dataclass(frozen=True)
class CheckpointMeta:
    """What a checkpoint says about itself (the JSON file next to DCP's shards).

    `model` names the model (e.g. `classifier:tiny`), `fingerprint` hashes its parameter names and shapes,
    `layout` is the parallel layout that wrote it (informative: loading does not depend on it), `config`
    the configuration of the job, `extras` anything JSON-serialisable the writer wanted back.
    """

    step: int
    model: str
    fingerprint: str
    layout: dict[str, Any]
    world_size: int
    config: dict[str, Any]
    extras: dict[str, Any]
    format: str = FORMAT


def final_folder(directory: Path, step: int) -> Path:
    """The committed folder of the checkpoint at `step`."""
    return directory / f"step-{step:08d}"


def partial_folder(directory: Path, step: int) -> Path:
    """Where the checkpoint at `step` is written before its commit (never read as a checkpoint)."""
    return directory / f"step-{step:08d}{_PARTIAL_SUFFIX}"


def _is_complete(folder: Path) -> bool:
    return folder.is_dir() and _COMPLETE.fullmatch(folder.name) is not None and (folder / META_FILE).is_file()


def _replaced_of(folder: Path) -> Path | None:
    """The committed folder `folder` held before a save of the same step replaced it, when it is such a copy."""
    match = _REPLACED.fullmatch(folder.name)
    return None if match is None or not (folder / META_FILE).is_file() else folder.with_name(match[1])


def complete_checkpoints(directory: Path) -> list[Path]:
    """Committed checkpoints in `directory`, oldest first (by step). A step whose commit was cut short between its
    two renames (see `commit`) counts by the copy it replaced, until `prune` puts it back."""
    if not directory.is_dir():
        return []
    folders = list(directory.iterdir())
    found = {folder.name: folder for folder in folders if _is_complete(folder)}
    for folder in folders:
        final = _replaced_of(folder)
        if final is not None and final.name not in found:
            found[final.name] = folder
    return [found[name] for name in sorted(found)]


def latest_checkpoint(directory: Path) -> Path | None:
    """The committed checkpoint with the highest step, or None."""
    found = complete_checkpoints(directory)
    return found[-1] if found else None


def damaged_hint(folder: Path) -> str:
    """What to do when the checkpoint `folder` cannot be read: the older complete checkpoints beside it."""
    older = [other for other in complete_checkpoints(folder.parent) if other.name < folder.name]
    if not older:
        return "the checkpoint is damaged and no older complete one is beside it; start afresh without --resume"
    names = ", ".join(other.name for other in older)
    return f"the checkpoint is damaged; resume an older complete one ({names}), e.g. --resume {older[-1]}"


def read_meta(folder: Path) -> CheckpointMeta:
    """The metadata of a committed checkpoint; ConfigError when it is not one."""
    path = folder / META_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{str(folder)!r} is not a pipetrain checkpoint (no {META_FILE})",
                          hint="pass a step-NNNNNNNN folder written by pipetrain, or the --save-dir holding them") from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot read {str(path)!r}: {err}", hint=damaged_hint(folder)) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ConfigError(f"{str(path)!r} has format {data.get('format') if isinstance(data, dict) else None!r}",
                          hint=f"this pipetrain reads {FORMAT} checkpoints")
    fields = {name: data[name] for name in CheckpointMeta.__dataclass_fields__ if name in data}
    try:
        return CheckpointMeta(**fields)
    except TypeError as err:
        raise ConfigError(f"{str(path)!r} is incomplete: {err}", hint=damaged_hint(folder)) from None


def write_meta(folder: Path, meta: CheckpointMeta) -> None:
    """Write the metadata file durably (flushed and fsynced) into `folder`."""
    path = folder / META_FILE
    with open(path, "w") as handle:
        json.dump(meta.__dict__, handle, indent=2, sort_keys=True)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(partial: Path, final: Path) -> None:
    """Make `partial` (whose files and metadata are all written) the committed checkpoint `final`.

    The rename is atomic on POSIX file systems: a reader sees the whole checkpoint or none of it. Replacing a
    committed folder of the same step takes two renames; a crash between them leaves the old copy under a name
    (`step-N.replaced-X`) that `complete_checkpoints` reads and `prune` restores, never deletes.
    """
    if final.exists():  # the same step saved again (e.g. resumed, then stopped at once): replace it
        old = final.with_name(f"{final.name}.replaced-{uuid.uuid4().hex[:8]}")
        os.rename(final, old)
        os.rename(partial, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(partial, final)
    _fsync_dir(final.parent)


def _restore_replaced(directory: Path) -> list[Path]:
    """Put back each replaced copy whose replacement never got its name (a crash between `commit`'s renames);
    return the replaced copies whose replacement did (to remove)."""
    spare = []
    for folder in directory.iterdir():
        final = _replaced_of(folder) if folder.is_dir() else None
        if final is None:
            continue
        if _is_complete(final):
            spare.append(folder)
        else:
            os.rename(folder, final)
    return spare


def prune(directory: Path, keep: int | None) -> list[Path]:
    """Restore a checkpoint whose replacement was cut short, then remove left-over partial folders, replaced copies
    and all but the `keep` newest checkpoints; returns what was removed."""
    removed = _restore_replaced(directory)
    removed += [folder for folder in directory.iterdir() if folder.is_dir() and folder.name.endswith(_PARTIAL_SUFFIX)]
    if keep is not None:
        removed += complete_checkpoints(directory)[:-keep]
    for folder in removed:
        shutil.rmtree(folder, ignore_errors=True)
    return removed


def probe_writable(directory: Path) -> None:
    """Create `directory` and a file in it, or raise ConfigError saying why the checkpoints cannot go there."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".probe-{uuid.uuid4().hex}"
        probe.write_bytes(b"pipetrain")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"cannot write checkpoints to --save-dir {str(directory)!r}: {err.strerror or err}",
                          hint="pass a --save-dir in a folder you can write to") from None

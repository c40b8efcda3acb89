"""The data settings a run trained with (`--data`, `--seq-len`, `--pack`, the row fields and `--truncate`), written
beside a model `pipetrain export` writes (`pipetrain-data.json`) and read back by `pipetrain eval --model`, so an
exported model is evaluated on its run's own windows and rows; and a digest of the data a run trains on, kept in
its checkpoints' data position, so that a resume on changed data is refused instead of skipping or repeating
samples silently."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from pipetrain.data.cache import files_digest
from pipetrain.data.fields import RowFormat

__all__ = ["SETTINGS_FILE", "SETTINGS", "data_settings", "write_data_settings", "read_data_settings", "data_digest"]

#: the file beside an exported model
SETTINGS_FILE = "pipetrain-data.json"
#: the settings kept (the `TrainConfig` field names)
SETTINGS = ("data", "seq_len", "pack", "row_format")


def data_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """The data settings of a job's configuration as JSON (`TrainConfig.as_json()`, what a checkpoint records)."""
    return {name: config.get(name) for name in SETTINGS if config.get(name) is not None}


def write_data_settings(folder: Path, config: Mapping[str, Any]) -> Path:
    """Write the data settings of `config` into the model folder `folder`; the file written."""
    path = Path(folder) / SETTINGS_FILE
    path.write_text(json.dumps(data_settings(config), indent=2, sort_keys=True) + "\n")
    return path


def read_data_settings(folder: Path) -> dict[str, Any] | None:
    """The data settings written beside the model of `folder` (None: it has none, e.g. not written by export)."""
    path = Path(folder) / SETTINGS_FILE
    if not path.is_file():
        return None
    try:
        settings = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return settings if isinstance(settings, dict) else None


def data_digest(path: Path | str | None, row_format: RowFormat) -> str | None:
    """A digest of the data at `path` (the files' content, as the tokenization cache keys it) and the fields read
    from it; None for no file (the workload's default data or its synthetic corpus)."""
    if path is None or not Path(path).exists():
        return None
    path = Path(path).resolve()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    stamp = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    fields = json.dumps(row_format.fields(), sort_keys=True)
    return hashlib.blake2b(f"{_content(path, stamp)}\0{fields}".encode(), digest_size=16).hexdigest()


@lru_cache(maxsize=8)
def _content(path: Path, stamp: tuple) -> str:
    """The content hash of `path` (as the tokenization cache keys it), once per process while `stamp` (the files'
    names, sizes and times) holds."""
    return files_digest([path])

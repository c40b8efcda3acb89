"""The identity of the base model a LoRA run adapts: its folder and a digest of its config and weights files.

A LoRA checkpoint holds the adapters only, so it is worth nothing on another base: the identity is recorded in the
checkpoint and compared on resume and on export. The digest covers config.json whole and, for each weights file
(`*.safetensors`, the shard index), its size, its safetensors header (every tensor's name, dtype, shape and
offsets) and its first and last MiB: a retrained or re-saved model differs there, and reading it costs milliseconds
even for a model of many shards (hashing every byte of a 70B model's files on every save would take minutes).
`pipetrain.checkpoint.state.check_compatible` compares the digests (the folder may have moved).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

__all__ = ["folder_identity", "config_identity"]

_EDGE = 1 << 20  # bytes hashed at each end of a weights file


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    size = path.stat().st_size
    digest.update(str(size).encode())
    with open(path, "rb") as f:
        if path.suffix == ".safetensors" and size >= 8:
            length = int.from_bytes(f.read(8), "little")
            digest.update(f.read(min(length, size - 8)))
            f.seek(0)
        digest.update(f.read(_EDGE))
        if size > 2 * _EDGE:
            f.seek(size - _EDGE)
            digest.update(f.read(_EDGE))
    return digest.hexdigest()


def folder_identity(folder: str | Path) -> dict[str, Any]:
    """The folder (absolute path) and a digest of its config.json and weights files."""
    folder = Path(folder).resolve()
    files = sorted(p for p in folder.iterdir() if p.name == "config.json" or p.suffix == ".safetensors"
                   or p.name.endswith(".safetensors.index.json"))
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.name}:{_file_digest(path)}\n".encode())
    return {"folder": str(folder), "digest": digest.hexdigest(), "files": [p.name for p in files]}


def config_identity(config_json: str) -> dict[str, Any]:
    """A model built from a config alone (a preset, no folder): a digest of the config."""
    return {"folder": None, "digest": hashlib.sha256(config_json.encode()).hexdigest(), "files": []}

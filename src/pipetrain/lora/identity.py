"""The identity of the base model a LoRA run adapts: its folder and a digest of its config and weights files.

A LoRA checkpoint holds the adapters only, so it is worth nothing on another base: the identity is recorded in the
checkpoint and compared on resume and on export. The digest covers config.json and every weights file
(`*.safetensors`, the shard index) whole, every byte, with xxHash's XXH3-128 (a checksum, not a cryptographic hash:
it tells a retrained, re-saved or damaged base from the one the adapters were trained on, not a forgery), the files
hashed side by side in threads. It runs at the speed the files are read: 1.4 GB/s for SmolLM2-135M's 538 MB file
from the page cache on a loaded 2-core machine (0.38 s; benchmarks/base_identity.py), so a 7-8B base (15-16 GB)
costs some seconds and a 70B one a minute or two, once per job (the model keeps it). Checkpoints written before (method
"edges": each file's size, safetensors header and first and last MiB only) are compared by their own method.
`pipetrain.checkpoint.meta.check_compatible` compares the digests (the folder may have moved).
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import xxhash

__all__ = ["WHOLE", "EDGES", "folder_identity", "config_identity"]

#: Every byte of each file (the method of checkpoints written now).
WHOLE = "whole-xxh3-128"
#: Each file's size, header and first and last MiB (checkpoints written before; read to compare them only).
EDGES = "edges"
_EDGE = 1 << 20  # bytes hashed at each end of a weights file by EDGES
_CHUNK = 1 << 23  # bytes read at a time by WHOLE


def _whole_digest(path: Path) -> str:
    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return f"{path.stat().st_size}:{digest.hexdigest()}"


def _edges_digest(path: Path) -> str:
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


def folder_identity(folder: str | Path, method: str = WHOLE) -> dict[str, Any]:
    """The folder (absolute path) and a digest of its config.json and weights files by `method` (WHOLE; EDGES
    only to compare with a checkpoint written before WHOLE)."""
    folder = Path(folder).resolve()
    files = sorted(p for p in folder.iterdir() if p.name == "config.json" or p.suffix == ".safetensors"
                   or p.name.endswith(".safetensors.index.json"))
    one = _whole_digest if method == WHOLE else _edges_digest
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(files), os.cpu_count() or 1))) as pool:
        digests = list(pool.map(one, files))
    digest = hashlib.sha256()
    for path, file_digest in zip(files, digests):
        digest.update(f"{path.name}:{file_digest}\n".encode())
    identity = {"folder": str(folder), "digest": digest.hexdigest(), "files": [p.name for p in files]}
    return identity if method == EDGES else {**identity, "method": method}


def config_identity(config_json: str) -> dict[str, Any]:
    """A model built from a config alone (a preset, no folder): a digest of the config."""
    return {"folder": None, "digest": hashlib.sha256(config_json.encode()).hexdigest(), "files": []}

"""Tokenization run once, in parallel over the node's cores with a progress bar, and cached on disk keyed by the
tokenizer's files, the data files' content and the fields read: the second run (and every rank of a launched job)
reads the cached Arrow files instead of tokenizing again, and a changed file or tokenizer is tokenized anew.

The cache is a folder per key, `tokens-<key>/` under `default_cache_root()` (`~/.cache/pipetrain/data`), holding
the tokenized rows (`datasets.Dataset.save_to_disk`) and `meta.json`; it is written under a temporary name and
renamed when complete, so two processes building it at once never read half of it. JSON and Parquet files are
converted into Arrow files first (memory-mapped while they are tokenized, deleted afterwards: the cache holds
the tokens alone).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import socket
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from pipetrain.data.fields import RowFormat, row_kind
from pipetrain.data.formats import detect_format, progress_bars, read_rows, require_datasets
from pipetrain.data.chat import check_chat_template
from pipetrain.data.render import tokenize_rows

__all__ = ["Tokenized", "build_folder_name", "default_cache_root", "files_digest", "tokenizer_digest", "tokenize_cached", "ROWS_PER_PROC"]

#: rows per tokenizing process below which fewer processes are started (a process costs more than it saves)
ROWS_PER_PROC = 2000
#: the files of a model folder that make its tokenizer (hashed into the cache key)
_TOKENIZER_GLOBS = ("tokenizer*", "special_tokens_map.json", "vocab*", "merges.txt", "added_tokens.json",
                    "chat_template*", "spiece.model")
_VERSION = 2  # 2: BOS/EOS as the tokenizer gives them, chat turns by sentinel


def default_cache_root() -> Path:
    """`~/.cache/pipetrain/data`: where tokenized data is kept."""
    return Path.home() / ".cache" / "pipetrain" / "data"


def files_digest(paths: list[Path]) -> str:
    """A content hash of `paths` (files, or folders: every file under them, by relative name and content)."""
    digest = hashlib.blake2b(digest_size=16)
    for path in paths:
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            digest.update(f"{file.relative_to(path) if path.is_dir() else file.name}\0{file.stat().st_size}\0".encode())
            with file.open("rb") as handle:
                while chunk := handle.read(1 << 20):
                    digest.update(chunk)
    return digest.hexdigest()


def tokenizer_digest(folder: Path) -> str:
    """A content hash of the tokenizer files of a model folder."""
    return files_digest(sorted({p for glob in _TOKENIZER_GLOBS for p in folder.glob(glob) if p.is_file()}))


@dataclass(frozen=True)
class Tokenized:
    """Tokenized rows (`input_ids`, `length`; `trained`, `first` for instruction and chat rows), memory-mapped."""

    rows: Any
    kind: str
    format: str
    cached: bool


def _processes(rows: int, procs: int | None) -> int | None:
    """The tokenizing processes for `rows` rows: the cores (or `procs`), fewer for few rows; None: this one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    count = min(procs or cores, rows // ROWS_PER_PROC)
    return count if count > 1 else None


def tokenize_cached(path: Path, fmt: RowFormat, tokenizer: Any, *, tokenizer_name: str, tokenizer_key: str,
                    cache_root: Path | None = None, procs: int | None = None) -> Tokenized:
    """The rows of `--data path` (JSON lines, Parquet, datasets folder) tokenized by `tokenizer` as `fmt` says, from
    the cache when it holds them, else tokenized now (over `procs` processes, default the cores) and stored. The
    tokenization shows a progress bar on a terminal; reading and storing show none."""
    datasets = require_datasets()
    root = cache_root or default_cache_root()
    data_format, files = detect_format(path)
    key = hashlib.blake2b(json.dumps({"version": _VERSION, "format": data_format, "fields": fmt.fields(),
                                      "tokenizer": tokenizer_key, "data": files_digest(files)},
                                     sort_keys=True).encode(), digest_size=16).hexdigest()
    final = root / f"tokens-{key}"
    if not (final / "meta.json").is_file():
        import filelock  # a dependency of datasets

        root.mkdir(parents=True, exist_ok=True)
        lock = root / f".tokens-{key}.lock"
        with filelock.FileLock(str(lock)):  # the ranks of a node: one tokenizes
            try:
                if not (final / "meta.json").is_file():
                    return _tokenize(datasets, path, fmt, tokenizer, tokenizer_name, data_format, files, root, key,
                                     procs)
            finally:  # no lock file left behind: a process still waiting on it finds the rows built (or builds
                lock.unlink(missing_ok=True)  # them in a folder of its own), one arriving later takes a new lock
    meta = json.loads((final / "meta.json").read_text())
    return Tokenized(datasets.load_from_disk(str(final / "rows")), meta["kind"], data_format, cached=True)


def build_folder_name(key: str) -> str:
    """The folder the rows of `key` are built in before the rename: unique to this builder across the nodes that
    share the cache folder (host name, process id and a random id: containers on two nodes may share a pid, and file
    locks may not hold across nodes, e.g. NFS `local_lock` or Lustre without flock), so no builder touches another's."""
    host = "".join(c if c.isalnum() or c in "-." else "_" for c in socket.gethostname()) or "host"
    return f".tokens-{key}.{host}.{os.getpid()}.{secrets.token_hex(6)}.partial"


def _tokenize(datasets: Any, path: Path, fmt: RowFormat, tokenizer: Any, tokenizer_name: str, data_format: str,
              files: list[Path], root: Path, key: str, procs: int | None) -> Tokenized:
    """Tokenize the rows now into `root/tokens-<key>` (see `tokenize_cached`): built in a folder of this process,
    renamed when complete; a failure leaves nothing behind."""
    building = root / build_folder_name(key)
    try:
        kind = _build(datasets, path, fmt, tokenizer, tokenizer_name, data_format, files, building, key, procs)
        try:
            building.rename(root / f"tokens-{key}")
        except OSError:  # another node's process (a shared cache folder) finished the same key first
            shutil.rmtree(building, ignore_errors=True)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    return Tokenized(datasets.load_from_disk(str(root / f"tokens-{key}" / "rows")), kind, data_format, cached=False)


def _build(datasets: Any, path: Path, fmt: RowFormat, tokenizer: Any, tokenizer_name: str, data_format: str,
           files: list[Path], building: Path, key: str, procs: int | None) -> str:
    """Read, tokenize and store the rows in `building`; returns their kind."""
    rows = read_rows(data_format, files, cache_dir=building / "arrow")  # Arrow files, deleted once tokenized
    source = f"--data {str(path)!r}"
    kind, fields = row_kind(rows.column_names, fmt, source)
    if kind == "chat":
        check_chat_template(tokenizer, tokenizer_name)
    features = {"input_ids": datasets.List(datasets.Value("int32")), "length": datasets.Value("int32")}
    if kind != "text":
        features.update(trained=datasets.List(datasets.Value("int8")), first=datasets.Value("int32"))
    if kind == "instruction":  # 1: the tokenizer merges prompt and answer across the joint: tokenized apart
        features.update(apart=datasets.Value("int8"))
    with progress_bars(datasets, sys.stderr.isatty()):
        mapped = rows.map(partial(tokenize_rows, tokenizer=tokenizer, kind=kind, fields=fields, source=source),
                          batched=True, with_indices=True, remove_columns=rows.column_names,
                          num_proc=_processes(len(rows), procs), features=datasets.Features(features),
                          desc=f"tokenizing {path.name}", cache_file_name=str(building / "map" / "tokens.arrow"),
                          load_from_cache_file=False, new_fingerprint=key)
    with progress_bars(datasets, False):
        mapped.save_to_disk(str(building / "rows"))
    count = len(rows)
    del mapped, rows
    for scratch in ("map", "arrow"):
        shutil.rmtree(building / scratch, ignore_errors=True)
    (building / "meta.json").write_text(json.dumps({"kind": kind, "format": data_format, "source": str(path),
                                                    "rows": count}))
    return kind

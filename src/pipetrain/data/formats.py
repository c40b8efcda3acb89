"""The format of `--data`, found from its files, and its rows read through Hugging Face `datasets` (memory-mapped
Arrow: a corpus larger than memory is read, not loaded).

`.txt` files are plain text (read by the workloads' own text readers, paragraphs or files as documents);
`.jsonl`/`.json` files are JSON lines (or one JSON array), `.parquet` files Parquet; a folder holds files of one of
these formats (searched recursively), or is a folder written by `datasets.Dataset.save_to_disk` (it has a
`state.json` or `dataset_dict.json`). JSON and Parquet are converted once into Arrow files under the cache folder
(`datasets.load_dataset(..., cache_dir=)`); a `save_to_disk` folder is memory-mapped where it lies.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pipetrain.data.lines import check_text, first_bad_line
from pipetrain.errors import ConfigError, DataError

__all__ = ["FORMATS", "SUFFIXES", "detect_format", "progress_bars", "rows_format", "read_rows", "read_texts",
           "require_datasets"]

#: file suffix -> format name (as the start-up line says it)
SUFFIXES = {".txt": "text", ".jsonl": "JSON lines", ".json": "JSON lines", ".parquet": "Parquet"}
#: every format `detect_format` names
FORMATS = ("text", "JSON lines", "Parquet", "datasets folder")
_SAVED = ("state.json", "dataset_dict.json")


def require_datasets() -> Any:
    """The `datasets` package, or one ConfigError saying how to install it."""
    try:
        import datasets
    except ImportError:
        raise ConfigError("reading JSON lines, Parquet or datasets folders needs the `datasets` and `pyarrow` "
                          "packages", hint="pip install 'pipetrain[data]'") from None
    return datasets


def detect_format(path: Path) -> tuple[str, list[Path]]:
    """The format of `--data path` (one of `FORMATS`) and its files (the folder itself for a datasets folder)."""
    if not path.exists():
        raise DataError(f"--data {str(path)!r} does not exist", hint="pass a file or a folder of your data")
    if path.is_file():
        return SUFFIXES.get(path.suffix.lower(), "text"), [path]
    if any((path / name).is_file() for name in _SAVED):
        return "datasets folder", [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in SUFFIXES)
    if not files:
        raise DataError(f"--data {str(path)!r} holds no .txt, .jsonl, .json or .parquet file and is not a folder "
                        "written by datasets' save_to_disk", hint="pass a folder of your data files")
    found = sorted({SUFFIXES[p.suffix.lower()] for p in files})
    if len(found) > 1:
        raise ConfigError(f"--data {str(path)!r} mixes formats ({', '.join(found)})",
                          hint="put the files of one format in a folder of their own and pass that folder")
    return found[0], files


def rows_format(path: Path) -> str | None:
    """The format of `--data path` when it is rows (JSON lines, Parquet, a datasets folder); None for plain text, or
    a path that is not there (the text readers say what is wrong with it)."""
    if not path.exists():
        return None
    try:
        fmt, _ = detect_format(path)
    except DataError:
        return None
    return None if fmt == "text" else fmt


def _check_parquet(files: list[Path]) -> None:
    import pyarrow.parquet as pq

    for file in files:
        try:
            pq.ParquetFile(file)  # the footer only
        except Exception as err:  # pyarrow's ArrowInvalid, OSError
            raise ConfigError(f"{str(file)!r} is not a Parquet file ({err})",
                              hint="write it with pandas' DataFrame.to_parquet or pyarrow.parquet.write_table, or "
                                   "give it the suffix of its real format (.jsonl, .txt)") from None


def read_rows(fmt: str, files: list[Path], *, cache_dir: Path) -> Any:
    """The rows of `files` in format `fmt` as a memory-mapped `datasets.Dataset` (JSON and Parquet converted into
    Arrow under `cache_dir` the first time); bad files raise one ConfigError or DataError."""
    datasets = require_datasets()
    if fmt == "datasets folder":
        try:
            saved = datasets.load_from_disk(str(files[0]))
        except (FileNotFoundError, ValueError) as err:
            raise DataError(f"{str(files[0])!r} is not a readable datasets folder: {err}",
                            hint="write it with Dataset.save_to_disk(DIR)") from None
        if isinstance(saved, datasets.DatasetDict):
            if "train" not in saved and len(saved) != 1:
                raise DataError(f"the datasets folder {str(files[0])!r} has the splits {', '.join(saved)} and no "
                                "'train'", hint="save the split to train on alone: dataset['NAME'].save_to_disk(DIR)")
            saved = saved["train"] if "train" in saved else next(iter(saved.values()))
        return saved
    if fmt == "Parquet":
        _check_parquet(files)
    if fmt == "JSON lines":
        for file in files:
            check_text(file)
    builder = {"JSON lines": "json", "Parquet": "parquet"}[fmt]
    try:  # its JSON reader logs each failure before raising it; its bars would come before pipetrain's lines
        with _quiet("datasets"), progress_bars(datasets, False):
            return datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train",
                                         cache_dir=str(cache_dir))
    except (datasets.exceptions.DatasetGenerationError, StopIteration, ValueError) as err:
        found = next((bad for bad in map(first_bad_line, files) if bad is not None), None) if fmt == "JSON lines" \
            else None
        if found is not None:
            raise found from None
        cause = err.__cause__ or err
        raise DataError(f"cannot read {', '.join(str(f) for f in files[:3])} as {fmt}: {cause}",
                        hint="check the file (one JSON object per line for .jsonl)") from None


@contextmanager
def progress_bars(datasets: Any, on: bool) -> Iterator[None]:
    """`datasets`' progress bars on (`on`) or off inside the block, as they were after it."""
    was_off = datasets.are_progress_bars_disabled()
    datasets.enable_progress_bars() if on else datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.disable_progress_bars() if was_off else datasets.enable_progress_bars()


@contextmanager
def _quiet(name: str) -> Iterator[None]:
    """The logger `name` silent inside the block (a failure is said once, by pipetrain's own message)."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(level)


def read_texts(path: Path, fmt: str, row_format: Any, *, cache_dir: Path) -> list[str]:
    """The plain-text field of the rows of `path` as a list of documents, for a workload with a word tokeniser (its
    vocabulary is built in memory from all of them): prompt/answer and chat rows need a model's own tokenizer."""
    from pipetrain.data.fields import row_kind

    _, files = detect_format(path)
    rows = read_rows(fmt, files, cache_dir=cache_dir)
    source = f"--data {str(path)!r}"
    kind, fields = row_kind(rows.column_names, row_format, source)
    if kind != "text":
        raise ConfigError(f"{source} holds {kind} rows, which train on their answers through a model's tokenizer "
                          "and chat template", hint="pass --workload hf --model DIR (a pretrained model folder)")
    texts = rows[fields[0]]
    return [text for text in texts if isinstance(text, str) and text.strip()]

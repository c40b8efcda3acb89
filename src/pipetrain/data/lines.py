"""What is wrong with a JSON lines file, in words a person knows: an empty file, bytes that are not UTF-8, a line that
is not one JSON object — each as one DataError naming the file, the 1-based line (and column) and the fix.

`check_text` runs before a file is read (a UTF-8 pass over its bytes: cheap beside the content hash the cache
computes anyway); `first_bad_line` runs only when the reader has failed, to say where and why in place of
pyarrow's words ("The document is empty.", a 0-based row)."""

from __future__ import annotations

import json
from pathlib import Path

from pipetrain.errors import DataError

__all__ = ["check_text", "first_bad_line"]


def check_text(file: Path) -> None:
    """One DataError when `file` holds no row (nothing but blank space) or bytes that are not UTF-8 text."""
    blank = True
    with file.open("rb") as handle:
        for number, line in enumerate(handle, 1):
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(f"line {number} of {str(file)!r} is not UTF-8 text: byte 0x{line[err.start]:02x} at "
                                f"column {err.start + 1} ({err.reason})",
                                hint="save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8 IN > OUT`) or remove "
                                     "that line") from None
            blank = blank and not text.strip()
    if blank:
        raise DataError(f"{str(file)!r} is empty: it holds no row",
                        hint="write one JSON object a line, e.g. {\"text\": \"...\"}, or pass another --data")


def first_bad_line(file: Path) -> DataError | None:
    """The DataError of the first line of `file` that is not one JSON object (a `.json` file that is one JSON array:
    the place where it stops being JSON), or None when every line is one."""
    text = file.read_text(encoding="utf-8", errors="replace")
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            return _bad(file, err.lineno, _words(err))
        if isinstance(rows, list) and all(isinstance(row, dict) for row in rows):
            return None
        return DataError(f"{str(file)!r} is a JSON array of something else than objects",
                         hint="write each row as an object, e.g. [{\"text\": \"...\"}, ...]")
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            return _bad(file, number, _words(err))
        if not isinstance(row, dict):
            return _bad(file, number, f"it is a JSON {type(row).__name__.replace('dict', 'object')}, not an object "
                                      "of fields")
    return None


#: Python's JSON messages in plain words
_WORDS = {"Unterminated string starting at": "a string opened at column {col} is not closed",
          "Expecting value": "a value is missing at column {col}",
          "Extra data": "more than one JSON value on the line (the second at column {col})",
          "Expecting property name enclosed in double quotes": "a field name at column {col} is not in double quotes",
          "Expecting ',' delimiter": "a comma is missing at column {col}",
          "Expecting ':' delimiter": "a colon is missing at column {col}"}


def _words(err: json.JSONDecodeError) -> str:
    return _WORDS.get(err.msg, err.msg + " at column {col}").format(col=err.colno)


def _bad(file: Path, line: int, what: str) -> DataError:
    return DataError(f"line {line} of {str(file)!r} is not one JSON object: {what}",
                     hint="fix or remove that line (one JSON object a line, e.g. {\"text\": \"...\"})")

"""The JSON-lines sink: every step and every evaluation as one line of `steps.jsonl` (`"kind"`: "step" | "eval")."""

from __future__ import annotations

import json
from pathlib import Path

from pipetrain.logs.records import EvalRecord, StepRecord, record_dict

__all__ = ["JsonLinesSink", "read_records"]


class JsonLinesSink:
    """Appends one JSON object per record to `path` (a resumed run writing to the same folder goes on with the
    same file), flushed after each line so that a reader (or a killed job) sees every finished step."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = path.open("a", encoding="utf-8")

    def _write(self, record: StepRecord | EvalRecord) -> None:
        self._file.write(json.dumps(record_dict(record)) + "\n")
        self._file.flush()

    def step(self, record: StepRecord) -> None:
        self._write(record)

    def eval(self, record: EvalRecord) -> None:
        self._write(record)

    def close(self) -> None:
        self._file.close()


def read_records(path: Path, kind: str | None = None) -> list[dict]:
    """The records of a `steps.jsonl` file, optionally only those of one `kind` ("step" or "eval")."""
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [r for r in records if kind is None or r["kind"] == kind]

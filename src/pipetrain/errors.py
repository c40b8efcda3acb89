"""The exception tree: every error a user can cause carries the offending value and a hint with the fix."""

from __future__ import annotations

__all__ = [
    "PipetrainError",
    "ConfigError",
    "DataError",
    "LaunchError",
    "RankFailedError",
    "RankTimeoutError",
    "CheckpointError",
    "NonFiniteError",
]


class PipetrainError(Exception):
    """Base of all errors pipetrain raises on purpose; the CLI prints them as one line and exits 2."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(f"{message} (hint: {hint})" if hint else message)


class ConfigError(PipetrainError):
    """A configuration value is invalid or inconsistent with another one."""


class DataError(PipetrainError):
    """A data folder is missing or does not have the expected layout."""


class LaunchError(PipetrainError):
    """The process environment (ranks, world size, Slurm variables) is inconsistent."""


class RankFailedError(PipetrainError):
    """Another rank failed; this rank stopped because of it."""


class RankTimeoutError(RankFailedError):
    """The ranks did not finish within the time they were given and were stopped."""


class CheckpointError(PipetrainError):
    """A checkpoint could not be written or read (full disk, damaged files); earlier checkpoints are intact."""


class NonFiniteError(PipetrainError):
    """Training diverged: a step's loss or gradient norm is nan or inf; the job stopped before that step's update."""

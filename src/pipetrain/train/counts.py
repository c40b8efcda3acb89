"""What of a job the command line alone settles, without torch: the synthetic corpus's name and default sizes, and
the counts a job needs positive (batch size, epochs, steps, samples, window). The command line checks them before its
heavy imports; `TrainConfig` checks them again on construction."""

from __future__ import annotations

from pipetrain.errors import ConfigError

__all__ = ["SYNTHETIC", "SYNTHETIC_TRAIN", "SYNTHETIC_TEST", "check_counts"]

#: `TrainConfig.data` (`--data`) naming the workload's synthetic corpus, and the corpus's default sizes.
SYNTHETIC = "synthetic"
SYNTHETIC_TRAIN, SYNTHETIC_TEST = 6000, 2000


def check_counts(*, batch_size: int, epochs: int | None, train_samples: int | None, test_samples: int | None,
                 seq_len: int | None, max_steps: int | None) -> None:
    """Raise ConfigError for a count below 1 (None: left to a default)."""
    for name, value in (("batch_size", batch_size), ("epochs", epochs), ("train_samples", train_samples),
                        ("test_samples", test_samples), ("seq_len", seq_len)):
        if value is not None and value < 1:
            raise ConfigError(f"{name} must be positive, got {value}", hint=f"pass a {name} of 1 or more")
    if max_steps is not None and max_steps < 1:
        raise ConfigError(f"max_steps must be positive, got {max_steps}", hint="pass --max-steps 1 or more")

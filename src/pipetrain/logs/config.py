"""What a training job logs and when it evaluates: `LogConfig` (the `--run-dir`, `--log-every`, `--tensorboard`,
`--eval-every`, `--eval-batches`, `--peak-tflops` and `--metrics` flags), the default run folder, and the checks that
its files can be written, made before any rank starts."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from pipetrain.errors import ConfigError
from pipetrain.logs.tensorboard import check_tensorboard

__all__ = ["LogConfig", "default_run_dir", "check_log_folders", "check_metrics_file", "probe_write", "RUNS_DIR"]

#: Where run folders go by default (relative to the working directory; git-ignored in this repository).
RUNS_DIR = Path("runs")


@dataclass(frozen=True, kw_only=True)
class LogConfig:
    """Logging and mid-epoch validation of one job (all of it written by rank 0 only).

    `run_dir`: the run's folder, which receives `steps.jsonl` (one JSON line per step and per evaluation) and
    `config.toml` (`config_text`, the effective configuration); None writes neither. `log_every`: a console
    line every N steps (when no progress bar is shown). `tensorboard`: a folder for TensorBoard event files.
    `eval_every`: evaluate on the held-out data every N optimizer steps (besides the end of each epoch);
    every evaluation (those and the end of each epoch's) reads at most `eval_batches` batches (None: all).
    `peak_tflops`: the peak TFLOP/s of one device for MFU (default: from the GPU's name; none on CPU).
    `metrics`: a JSON file of the epoch reports, written at the end.
    """

    run_dir: Path | None = None
    log_every: int = 10
    tensorboard: Path | None = None
    eval_every: int | None = None
    eval_batches: int | None = None
    peak_tflops: float | None = None
    config_text: str = ""
    #: (step seconds, rank-0 MB) a planner predicted (`--layout auto`): logged beside the measured ones
    predicted: tuple[float, float] | None = None
    metrics: Path | None = None
    #: a rank slower than the median of its stage position's others by this factor is named (logs/stragglers.py)
    straggler_factor: float = 1.3
    #: generate `sample_tokens` tokens (greedy) from `sample_prompt` every `sample_every` steps (`--sample-every`)
    sample_every: int | None = None
    sample_prompt: str | None = None
    sample_tokens: int = 32

    def __post_init__(self) -> None:
        for name, value in (("log_every", self.log_every), ("eval_every", self.eval_every),
                            ("eval_batches", self.eval_batches), ("sample_every", self.sample_every),
                            ("sample_tokens", self.sample_tokens)):
            if value is not None and (isinstance(value, bool) or value < 1):
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag} must be 1 or more, got {value}", hint=f"pass {flag} 1 or more")
        if (self.sample_every is None) != (self.sample_prompt is None):
            given, missing = (("--sample-every", "--sample-prompt TEXT") if self.sample_prompt is None
                              else ("--sample-prompt", "--sample-every N"))
            raise ConfigError(f"{given} needs {missing}", hint="pass both --sample-every N and --sample-prompt TEXT")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ConfigError(f"--peak-tflops must be positive, got {self.peak_tflops:g}",
                              hint="pass the dense peak TFLOP/s of one device, e.g. --peak-tflops 989")
        if not self.straggler_factor > 1:
            raise ConfigError(f"--straggler-factor must be above 1, got {self.straggler_factor:g}",
                              hint="pass how many times slower than its peers a rank may be, e.g. "
                                   "--straggler-factor 1.3")
        if self.tensorboard is not None:
            check_tensorboard()

    def eval_due(self, step: int, *, epoch_end: bool) -> bool:
        """Whether to evaluate after optimizer step `step`. At the end of an epoch the evaluation is left to the
        end-of-epoch one, which reads the same batches (`eval_batches` bounds both) and gives the same figures."""
        return self.eval_every is not None and step % self.eval_every == 0 and not epoch_end


def default_run_dir(workload: str, now: datetime | None = None, pid: int | None = None) -> Path:
    """`runs/<workload>-<UTC time>-p<pid>`, e.g. `runs/classifier-20260101-120000-p4242` (the process id keeps
    two jobs started in the same second apart)."""
    stamp = (now or datetime.now(timezone.utc)).strftime("%Y%m%d-%H%M%S")
    return RUNS_DIR / f"{workload}-{stamp}-p{os.getpid() if pid is None else pid}"


def _check_folder(path: Path, flag: str) -> None:
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag} {str(path)!r} is not a folder", hint=f"pass {flag} with a folder path")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot write {flag} {str(path)!r}: {str(existing)!r} is not a writable folder",
                          hint=f"pass {flag} in a folder you can write to")


def check_log_folders(config: LogConfig) -> None:
    """Before any rank starts: the run folder and the TensorBoard folder can be created (nothing is created)."""
    if config.run_dir is not None:
        _check_folder(Path(config.run_dir), "--run-dir")
    if config.tensorboard is not None:
        _check_folder(Path(config.tensorboard), "--tensorboard")


def probe_write(probe: Path, what: str, *, hint: str, folder: Path | None = None) -> None:
    """Create `folder` (when given), then write and remove the empty file `probe`; else a ConfigError
    "cannot write `what`: why" with `hint`."""
    try:
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"cannot write {what}: {err.strerror or err}", hint=hint) from None


def check_metrics_file(metrics: Path | None) -> None:
    """Fail now, not after training, when the metrics file cannot be written: write its temporary file."""
    if metrics is None:
        return
    folder = metrics.parent
    what = f"the metrics file {str(metrics)!r}"
    if metrics.is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        why = "is a folder" if metrics.is_dir() else f"its folder {str(folder)!r} is missing or not writable"
        raise ConfigError(f"cannot write {what}: {why}",
                          hint="pass --metrics with a file path in an existing folder you can write to")
    probe_write(metrics.with_name(f".{metrics.name}.partial"), what,
                hint="pass --metrics with a file path in a folder you can write to")

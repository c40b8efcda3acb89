"""The console sink: one readable line every N steps (what a Slurm log or any non-terminal run shows)."""

from __future__ import annotations

import logging

from pipetrain.logs.records import EvalRecord, StepRecord
from pipetrain.logs.stragglers import DEFAULT_STRAGGLER_FACTOR, straggler_line

__all__ = ["ConsoleSink", "step_line", "eval_line"]

log = logging.getLogger("pipetrain")


def _metrics(accuracy: float | None, perplexity: float | None) -> list[str]:
    return ([f"acc {accuracy:.3f}"] if accuracy is not None else []) + (
        [f"ppl {perplexity:.2f}"] if perplexity is not None else [])


def _extras(extras: dict[str, float]) -> list[str]:
    """A loss's own figures, e.g. ``rewards/margins 0.412`` (TRL's names)."""
    return [f"{name} {value:.4g}" for name, value in extras.items()]


def _rate(per_s: float) -> str:
    """A rate as a whole number, or with two significant digits under 10 (0.21, not 0)."""
    return f"{per_s:.0f}" if per_s >= 10 else f"{per_s:.2g}"


def step_line(record: StepRecord, total_steps: int | None = None) -> str:
    """e.g. ``step 120/940 | loss 0.4123 | acc 0.812 | lr 9.1e-04 | gnorm 1.32 | 412 samples/s | 0.155 s/step |
    mem 512 MB``: fields in this fixed order; absent ones (accuracy, grad norm, memory, MFU) left out. A token
    loss shows the tokens the model processed per second instead of samples/s, and the trained ones beside them
    when fewer (``8192 tokens/s (37 trained)``: instruction rows train their answers only)."""
    parts = [f"step {record.step}" + (f"/{total_steps}" if total_steps else ""), f"loss {record.loss:.4f}",
             *_metrics(record.accuracy, record.perplexity), *_extras(record.extras), f"lr {record.lr:.1e}"]
    if record.grad_norm is not None:
        parts.append(f"gnorm {record.grad_norm:.2f}")
    if record.window_tokens_per_s is not None:  # what the model processed; then what trained, when fewer
        trained = record.tokens_per_s
        parts.append(f"{record.window_tokens_per_s:.0f} tokens/s" + (
            f" ({_rate(trained)} trained)" if trained is not None and trained < record.window_tokens_per_s else ""))
    elif record.tokens_per_s is not None:
        parts.append(f"{record.tokens_per_s:.0f} tokens/s")
    else:
        parts.append(f"{record.samples_per_s:.0f} samples/s")
    parts.append(f"{record.step_time_s:.3f} s/step")
    if record.peak_mem_mb is not None:
        parts.append(f"mem {record.peak_mem_mb:.0f} MB")
    if record.mfu is not None:
        parts.append(f"mfu {100 * record.mfu:.1f}%")
    if record.skipped:
        parts.append("skipped")
    return " | ".join(parts)


def eval_line(record: EvalRecord) -> str:
    """e.g. ``eval at step 200 | loss 0.5012 | acc 0.771 | 32 batches in 1.2 s`` (no loss where it measures
    none: GRPO's ``eval at step 20 | reward 0.4062 | ...``)."""
    return " | ".join([f"eval at step {record.step}", *([] if record.loss is None else [f"loss {record.loss:.4f}"]),
                       *_metrics(record.accuracy, record.perplexity), *_extras(record.extras),
                       f"{record.batches} batch{'' if record.batches == 1 else 'es'} in {record.seconds:.1f} s"])


class ConsoleSink:
    """Logs every evaluation and, with `steps`, `step_line` every `every` steps and at the last step, to the
    `pipetrain` logger; the stragglers a record names, always (a warning)."""

    def __init__(self, *, every: int, total_steps: int | None = None, steps: bool = True,
                 straggler_factor: float = DEFAULT_STRAGGLER_FACTOR) -> None:
        self.every = every
        self.total_steps = total_steps
        self.steps = steps
        self.straggler_factor = straggler_factor

    def step(self, record: StepRecord) -> None:
        if self.steps and (record.step % self.every == 0 or record.step == self.total_steps):
            log.info(step_line(record, self.total_steps))
        for straggler in record.stragglers:  # under a progress bar too
            log.warning("pipetrain: %s", straggler_line(straggler, record.step, self.straggler_factor))

    def eval(self, record: EvalRecord) -> None:
        log.info(eval_line(record))

    def close(self) -> None:
        pass

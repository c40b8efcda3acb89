"""The records the training loop hands to its log sinks: one `StepRecord` per optimizer step, one `EvalRecord`
per held-out evaluation (plain frozen data, global figures identical on every rank unless said otherwise)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["StepRecord", "EvalRecord", "record_dict"]


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """One optimizer step.

    `loss` is the step's mean loss over the global batch, `accuracy` and `perplexity` the workload's metrics
    (None when it has none). `samples` is the global batch; `tokens` is what a token loss counts (the
    non-padding tokens of the global batch; None for a per-sample loss). `lr` is the first parameter group's
    learning rate the step used; `grad_norm` the global gradient norm when the loop computes one (else None).
    `step_time_s` is the wall time of the step on rank 0 (zero_grad, forward, backward, optimizer; on CUDA the
    optimizer's last kernels may finish within the next step, which the mean over steps absorbs);
    `peak_mem_mb` rank 0's peak memory so far (CUDA: allocated by torch; CPU: the process's peak RSS);
    `mfu` the model FLOPs utilisation (None unless a peak FLOP/s is known, see `pipetrain.logs.mfu`).
    `skipped` is True for a step whose update was not applied (e.g. a non-finite gradient).
    """

    step: int
    epoch: int
    loss: float
    lr: float
    samples: int
    step_time_s: float
    samples_per_s: float
    accuracy: float | None = None
    perplexity: float | None = None
    grad_norm: float | None = None
    tokens: int | None = None
    tokens_per_s: float | None = None
    peak_mem_mb: float | None = None
    mfu: float | None = None
    skipped: bool = False


@dataclass(frozen=True, kw_only=True)
class EvalRecord:
    """One evaluation on held-out data after optimizer step `step`: `trigger` is "every" (`--eval-every`) or
    "epoch" (the end of an epoch, or of the run); `batches` is how many batches it read."""

    step: int
    epoch: int
    loss: float
    batches: int
    seconds: float
    trigger: str = "every"
    accuracy: float | None = None
    perplexity: float | None = None


def record_dict(record: StepRecord | EvalRecord) -> dict[str, Any]:
    """`record` as JSON data with a leading `"kind"`: "step" or "eval"."""
    kind = "step" if isinstance(record, StepRecord) else "eval"
    return {"kind": kind, **asdict(record)}

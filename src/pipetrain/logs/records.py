"""The records of a run, one family of plain data (global figures, identical on every rank unless said otherwise):
one `StepRecord` per optimizer step and one `EvalRecord` per held-out evaluation, which the loop hands to its log
sinks; `MetricTotals`, the running means of an epoch; one `EpochReport` per epoch (the `--metrics` file)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # plain data: no torch at import
    from pipetrain.pipeline.engine import StepResult

__all__ = ["StepRecord", "EvalRecord", "record_dict", "EpochReport", "MetricTotals", "report_dicts", "perplexity"]


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """One optimizer step.

    `loss` is the step's mean loss over the global batch, `accuracy` and `perplexity` the workload's metrics
    (None when it has none). `samples` is the global batch; `tokens` is what a token loss counts (the tokens
    that train in the global batch: the non-padding targets, or for instruction and chat rows the answers alone;
    None for a per-sample loss); `window_tokens` the positions the model processes for it (samples × the batch's
    sequence length, padding included: what MFU counts; None for a per-sample loss). `lr` is the first parameter group's
    learning rate the step used; `grad_norm` the global gradient norm when the loop computes one (else None).
    `step_time_s` is the wall time of the step on rank 0 (zero_grad, forward, backward, optimizer; on CUDA the
    optimizer's last kernels may finish within the next step, which the mean over steps absorbs);
    `peak_mem_mb` rank 0's peak memory so far (CUDA: allocated by torch; CPU: the process's peak RSS);
    `mfu` the model FLOPs utilisation (None unless a peak FLOP/s is known, see `pipetrain.logs.mfu`).
    `skipped` is True for a step whose update was not applied (e.g. a non-finite gradient).
    `stragglers`: at the end of a `--log-every` window, the ranks named slow (`logs.stragglers.Straggler` as
    dicts; left out of the JSON line when there are none). `extras`: the loss's own figures (a preference
    objective's `rewards/chosen`, ...; `StepResult.extras`), written as top-level fields of the JSON line.
    A mixture of experts: `expert_load` each MoE layer's max / mean tokens per expert this step (by layer index),
    `dropped_fraction` the fraction of its token-slots the expert capacity dropped (None without `--moe-capacity`);
    both left out of the JSON line when absent.
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
    window_tokens: int | None = None
    window_tokens_per_s: float | None = None
    peak_mem_mb: float | None = None
    mfu: float | None = None
    skipped: bool = False
    stragglers: tuple[dict, ...] = ()
    expert_load: dict[int, float] = field(default_factory=dict)
    dropped_fraction: float | None = None
    extras: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class EvalRecord:
    """One evaluation on held-out data after optimizer step `step`: `trigger` is "every" (`--eval-every`) or
    "epoch" (the end of an epoch, or of the run); `batches` is how many batches it read; `extras` as a step's.
    `loss` None: the evaluation measures none (GRPO's: the held-out prompts' reward, in `extras`)."""

    step: int
    epoch: int
    loss: float | None
    batches: int
    seconds: float
    trigger: str = "every"
    accuracy: float | None = None
    perplexity: float | None = None
    extras: dict[str, float] = field(default_factory=dict)


def record_dict(record: StepRecord | EvalRecord) -> dict[str, Any]:
    """`record` as JSON data with a leading `"kind"`: "step" or "eval"."""
    kind = "step" if isinstance(record, StepRecord) else "eval"
    data = {"kind": kind, **asdict(record)}
    for name in ("stragglers", "expert_load", "dropped_fraction"):  # left out when absent
        if name in data and (data[name] is None or (isinstance(data[name], (tuple, list, dict)) and not data[name])):
            del data[name]
    data.update(data.pop("extras", {}))  # TRL's names ("rewards/chosen") as fields of their own
    return data


def perplexity(loss: float, metrics: tuple[str, ...]) -> float | None:
    """exp(`loss`) when the workload reports perplexity among its `metrics`, else None."""
    return math.exp(min(loss, 700.0)) if "perplexity" in metrics else None


class MetricTotals:
    """Running means of loss and accuracy over steps, each step weighted by what its loss averages over."""

    def __init__(self, loss: float = 0.0, correct: float = 0.0, count: float = 0.0,
                 extras: dict[str, float] | None = None) -> None:
        self.loss, self.correct, self.count = loss, correct, count
        self.extras = dict(extras or {})  # sums of each extra figure, weighted as the loss

    def add(self, result: StepResult) -> None:
        self.loss += result.loss * result.count
        self.correct += (result.accuracy or 0.0) * result.count
        self.count += result.count
        for name, value in result.extras.items():
            self.extras[name] = self.extras.get(name, 0.0) + value * result.count

    def extra_means(self) -> dict[str, float]:
        """The means of the loss's own figures (`StepResult.extras`) over what it counts."""
        return {name: value / max(self.count, 1.0) for name, value in self.extras.items()}

    def means(self) -> tuple[float, float]:
        count = max(self.count, 1.0)
        return self.loss / count, self.correct / count


@dataclass(frozen=True)
class EpochReport:
    """What one epoch measured (global figures, identical on every rank). Accuracy is per sample for a
    classifier and per token for a language model; perplexity is None unless the workload reports it. The
    `test_*` figures are those of the epoch's last evaluation (see `of`)."""

    epoch: int
    steps: int
    train_loss: float
    train_accuracy: float
    test_loss: float | None
    test_accuracy: float | None
    seconds: float
    synthetic: bool
    data: str = ""
    train_perplexity: float | None = None
    test_perplexity: float | None = None
    best_eval: dict | None = None  # the lowest held-out loss so far (an EvalRecord as a dict)
    #: what the `test_*` figures were measured on: "test", "held-out", "synthetic test", ...
    eval_split: str = "test"
    test_reward: float | None = None  # an evaluation without a loss (GRPO): its mean reward (test_loss None)

    @classmethod
    def of(cls, epoch: int, step: int, trained: MetricTotals, tested: MetricTotals, *, seconds: float, synthetic: bool,
           data: str, metrics: tuple[str, ...], best: EvalRecord | None, eval_split: str,
           held_out: EvalRecord | None = None) -> EpochReport:
        """The report of epoch `epoch`, ended at step `step`: its steps added up to `trained`, its last evaluation
        to `tested` (`held_out` its record: one without a loss gives its reward instead); `metrics` are the
        workload's (perplexity when it names it); `best` the best evaluation so far."""
        (train_loss, train_accuracy), (test_loss, test_accuracy) = trained.means(), tested.means()
        best_dict = asdict(best) if best else None
        if held_out is not None and held_out.loss is None:
            return cls(epoch, step, train_loss, train_accuracy, None, None, seconds, synthetic, data,
                       perplexity(train_loss, metrics), None, best_dict, eval_split, held_out.extras.get("reward"))
        return cls(epoch, step, train_loss, train_accuracy, test_loss, test_accuracy, seconds, synthetic, data,
                   perplexity(train_loss, metrics), perplexity(test_loss, metrics), best_dict, eval_split)

    def line(self, epochs: int) -> str:
        def ppl(value: float | None) -> str:
            return "" if value is None else f" ppl {value:.2f}"

        if self.test_loss is not None:
            tested = (f"{self.eval_split} loss {self.test_loss:.4f} acc {self.test_accuracy:.3f}"
                      f"{ppl(self.test_perplexity)}")
        else:
            tested = "" if self.test_reward is None else f"{self.eval_split} reward {self.test_reward:.4f}"
        return (
            f"epoch {self.epoch}/{epochs}  train loss {self.train_loss:.4f} acc {self.train_accuracy:.3f}"
            f"{ppl(self.train_perplexity)}  {tested}  time {self.seconds:.1f}s  steps {self.steps}  ({self.data})"
        )


def report_dicts(reports: list[EpochReport]) -> list[dict]:
    """Epoch reports as plain dicts (for JSON output)."""
    return [asdict(report) for report in reports]

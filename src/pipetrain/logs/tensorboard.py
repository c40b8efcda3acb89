"""The TensorBoard sink: scalars `train/...` per step and `eval/...` per evaluation (needs the `tensorboard` extra)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from pipetrain.errors import ConfigError
from pipetrain.logs.records import EvalRecord, StepRecord

__all__ = ["TensorBoardSink", "check_tensorboard", "STEP_TAGS", "EVAL_TAGS"]

#: StepRecord field -> tag (fields that are None in a record are not written)
STEP_TAGS = {
    "loss": "train/loss", "accuracy": "train/accuracy", "perplexity": "train/perplexity", "lr": "train/lr",
    "grad_norm": "train/grad_norm", "samples_per_s": "train/samples_per_s", "tokens_per_s": "train/tokens_per_s",
    "window_tokens_per_s": "train/window_tokens_per_s",
    "step_time_s": "train/step_time_s", "peak_mem_mb": "train/peak_mem_mb", "mfu": "train/mfu",
}
#: EvalRecord field -> tag
EVAL_TAGS = {"loss": "eval/loss", "accuracy": "eval/accuracy", "perplexity": "eval/perplexity"}


def check_tensorboard() -> None:
    """Raise ConfigError when the `tensorboard` package (which torch's SummaryWriter needs) is missing."""
    if importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("--tensorboard needs the tensorboard package, which is not installed",
                          hint="pip install 'pipetrain[tensorboard]'")


class TensorBoardSink:
    """Event files in `folder` (open it with `tensorboard --logdir FOLDER`), written by torch's SummaryWriter."""

    def __init__(self, folder: Path) -> None:
        check_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(folder))

    def _scalars(self, record: StepRecord | EvalRecord, tags: dict[str, str]) -> None:
        for name, tag in tags.items():
            value = getattr(record, name)
            if value is not None:
                self._writer.add_scalar(tag, float(value), record.step)

    def _extras(self, record: StepRecord | EvalRecord, prefix: str) -> None:
        for name, value in record.extras.items():  # a loss's own figures: train/rewards/chosen, ...
            self._writer.add_scalar(f"{prefix}/{name}", float(value), record.step)

    def step(self, record: StepRecord) -> None:
        self._scalars(record, STEP_TAGS)
        self._extras(record, "train")

    def eval(self, record: EvalRecord) -> None:
        self._scalars(record, EVAL_TAGS)
        self._extras(record, "eval")

    def sample(self, step: int, prompt: str, text: str) -> None:
        """A text generated during training (`--sample-every`), under the tag `samples`."""
        self._writer.add_text("samples", f"**{prompt}**{text}", step)

    def close(self) -> None:
        self._writer.close()

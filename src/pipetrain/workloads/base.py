"""What a workload is: the `Workload` base class the trainer calls (model, data, batches, loss, metrics), the
`DataRequest` it answers and the `Dataset` it returns. Subclass `Workload` to train your own model and data."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch

from pipetrain.blocks import BlockModel
from pipetrain.errors import ConfigError

__all__ = ["Batch", "Dataset", "DataRequest", "Workload"]

#: One batch: the first stage's input(s) (a tensor or a tuple of tensors) and the last stage's targets.
Batch = tuple["torch.Tensor | tuple[torch.Tensor, ...]", torch.Tensor]


class Dataset(Protocol):
    """What the trainer needs to know about a dataset; the workload's `batches` reads the rest."""

    synthetic: bool
    source: str

    def __len__(self) -> int: ...


@dataclass(frozen=True, kw_only=True)
class DataRequest:
    """Which data the trainer wants: the synthetic corpus of `train_samples` / `test_samples` samples when
    `synthetic`, else the folder/file `path`, else (`path` None) the workload's default data (its
    `default_data`; the synthetic corpus for a workload without one). `seq_len`, when set, is the window (tokens
    per sample) of a workload that `windows`, instead of its default."""

    preset: str
    path: Path | None
    synthetic: bool
    train_samples: int
    test_samples: int
    seed: int
    seq_len: int | None = None

    def __post_init__(self) -> None:
        if self.synthetic and self.path is not None:
            raise ConfigError(f"data request for both the synthetic corpus and {str(self.path)!r}",
                              hint="ask for one of them")


class Workload(ABC):
    """One kind of training job. Subclasses set `name`, `summary`, `presets` and `metrics`.

    `metrics` names the `StepResult` fields the trainer reports besides the loss (e.g. `accuracy`,
    `perplexity`). `batches` yields this replica's share of each global batch, in the same number on every
    replica (see `num_batches`); `bucket` asks for batches of similar lengths where the data has lengths.
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    presets: ClassVar[Mapping[str, Any]]
    metrics: ClassVar[tuple[str, ...]] = ("accuracy",)
    data_help: ClassVar[str] = ""
    #: whether `batches(..., bucket=True)` groups samples by length (else --bucket is refused)
    buckets: ClassVar[bool] = False
    #: the real data loaded when a job names none (no --data), or None: the synthetic corpus is the default
    default_data: ClassVar[str | None] = None
    #: whether `model(preset, seq_len=N)` and `DataRequest.seq_len` change the window (else --seq-len is refused)
    windows: ClassVar[bool] = False

    def check_preset(self, preset: str) -> None:
        """Raise ConfigError unless `preset` is one of this workload's presets."""
        if preset not in self.presets:
            raise ConfigError(
                f"unknown preset {preset!r} for workload {self.name!r}", hint=f"choose one of: {', '.join(self.presets)}"
            )

    @abstractmethod
    def model(self, preset: str) -> BlockModel:
        """The model of `preset` as a `BlockModel` (cheap: blocks are built later, each on its own rank); a workload
        that `windows` also takes `seq_len=` (the window, default the preset's)."""

    def with_model(self, folder: str | Path, *, pack: bool = True) -> Workload:
        """This workload on the pretrained model of a local folder (`--model DIR`); `pack`: whether text is
        packed into windows. Only a workload of pretrained models has one (`hf`)."""
        raise ConfigError(f"workload {self.name!r} does not train a pretrained model folder: --model does not apply",
                          hint=f"pass --workload hf --model {folder}, or drop --model")

    def job_defaults(self, *, synthetic: bool) -> dict[str, Any]:
        """What a job on this data does when it does not say: `bucket` (batches of similar lengths) and `epochs`."""
        return {"bucket": False, "epochs": 2}

    def window(self, preset: str, *, seq_len: int | None, synthetic: bool) -> int | None:
        """The window a job trains with: `seq_len` when given, else the preset's for this kind of data (None for
        a workload that does not `windows`)."""
        return None

    @abstractmethod
    def load_data(self, request: DataRequest) -> tuple[Dataset, Dataset]:
        """The train and evaluation datasets of `request` (the synthetic ones are deterministic)."""

    @abstractmethod
    def batches(
        self, dataset: Dataset, batch_size: int, *, shuffle: bool, seed: int, epoch: int,
        replica: int, replicas: int, bucket: bool = False,
    ) -> Iterator[Batch]:
        """One epoch of this replica's `(inputs, targets)` batches; `batch_size` is the global batch."""

    @abstractmethod
    def num_batches(self, dataset: Dataset, batch_size: int, *, replicas: int) -> int:
        """How many batches `batches` yields per epoch to each replica."""

    @abstractmethod
    def loss(self) -> Callable[..., torch.Tensor]:
        """The loss the pipeline engine minimises (a mean-reducing function, or a token loss)."""

    def describe_data(self, dataset: Dataset) -> str:
        """A short label of the data for progress lines."""
        return "synthetic data" if dataset.synthetic else "real data"

    def eval_split(self, dataset: Dataset) -> str:
        """What the evaluation dataset is, in one word or two ("test", "held-out", "synthetic test")."""
        return "synthetic test" if dataset.synthetic else "test"

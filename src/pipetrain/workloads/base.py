"""What a workload is: the `Workload` base class the trainer calls (model, data, batches, loss, metrics), the
`DataRequest` it answers and the `Dataset` it returns. Subclass `Workload` to train your own model and data."""

from __future__ import annotations

import functools
import inspect
import itertools
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch

from pipetrain.blocks import BlockModel
from pipetrain.data.fields import RowFormat
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
    per sample) of a workload that `windows`, instead of its default. `row_format`: which fields of JSON lines,
    Parquet or datasets rows hold the text, and what a row longer than the window does (`pipetrain.data`)."""

    preset: str
    path: Path | None
    synthetic: bool
    train_samples: int
    test_samples: int
    seed: int
    seq_len: int | None = None
    row_format: RowFormat = RowFormat()

    def __post_init__(self) -> None:
        if self.synthetic and self.path is not None:
            raise ConfigError(f"data request for both the synthetic corpus and {str(self.path)!r}",
                              hint="ask for one of them")


class Workload(ABC):
    """One kind of training job. Subclasses set `name`, `summary`, `presets` and `metrics`.

    `metrics` names the `StepResult` fields the trainer reports besides the loss (e.g. `accuracy`,
    `perplexity`). `batches` yields this replica's share of each global batch, in the same number on every
    replica (see `num_batches`); `bucket` asks for batches of similar lengths where the data has lengths.
    A subclass written before `model` took `seq_len` (`def model(self, preset)`) keeps working, with a
    DeprecationWarning when the class is defined.

    The data position (docs/long-jobs.md): the order of an epoch's samples depends on `seed` and `epoch` alone
    (never on `replica`/`replicas`), and `batches(..., start=S)` yields the global batches that begin at global
    sample `S` of that order, computing where they are instead of building the batches before them: a job
    resumed under another layout then trains exactly what the uninterrupted job would have. A subclass whose
    `batches` takes no `start` keeps working: its epoch is read from the beginning and the batches before the
    position are skipped (`seeks` is False).
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
    #: whether `batches` takes `start` (set from its signature when the class is defined; see `batches_from`)
    seeks: ClassVar[bool] = True
    #: the rows of a batch one sample makes (a preference pair: 2, chosen and rejected); an evaluation cuts its
    #: batches over the replicas between samples (`workloads.evaluation`)
    rows_per_sample: ClassVar[int] = 1

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        model = cls.__dict__.get("model")
        if callable(model) and not _takes_seq_len(model):
            warnings.warn(f"{cls.__qualname__}.model(self, preset) takes no seq_len: write "
                          "model(self, preset, *, seq_len=None) (the old form is deprecated)", DeprecationWarning,
                          stacklevel=2)
            cls.model = _without_seq_len(model)  # type: ignore[method-assign]
        batches = cls.__dict__.get("batches")
        if callable(batches) and "seeks" not in cls.__dict__:  # (a class may say it itself)
            try:
                cls.seeks = _takes(batches, "start")
            except (TypeError, ValueError):  # no signature to read: read its epochs from the start
                cls.seeks = False

    def check_preset(self, preset: str) -> None:
        """Raise ConfigError unless `preset` is one of this workload's presets."""
        if preset not in self.presets:
            raise ConfigError(
                f"unknown preset {preset!r} for workload {self.name!r}", hint=f"choose one of: {', '.join(self.presets)}"
            )

    @abstractmethod
    def model(self, preset: str, *, seq_len: int | None = None) -> BlockModel:
        """The model of `preset` as a `BlockModel` (cheap: blocks are built later, each on its own rank). `seq_len`:
        the window (None: the preset's); a workload that does not `windows` refuses any other (`check_window`)."""

    def check_window(self, seq_len: int | None) -> None:
        """Raise ConfigError when a window is asked of a workload that does not `windows`."""
        if seq_len is not None and not self.windows:
            raise _no_window(self.name)

    def with_model(self, folder: str | Path, *, pack: str | bool = "windows") -> Workload:
        """This workload on the pretrained model of a local folder (`--model DIR`); `pack`: how text fills the
        windows (`pipetrain.data.packing.PACK_MODES`). Only a workload of pretrained models has one (`hf`)."""
        raise ConfigError(f"workload {self.name!r} does not train a pretrained model folder: --model does not apply",
                          hint=f"pass --workload hf --model {folder}, or drop --model")

    def job_defaults(self, *, synthetic: bool) -> dict[str, Any]:
        """What a job on this data does when it does not say: `bucket` (batches of similar lengths) and `epochs`."""
        return {"bucket": False, "epochs": 2}

    def recipe_defaults(self, *, synthetic: bool, max_steps: int | None = None) -> dict[str, Any]:
        """The recipe a job on this data (of at most `max_steps` steps, when set) trains with where `pipetrain train`'s
        flags are silent: `RecipeConfig` fields among `lr_schedule`, `warmup_steps` and `grad_clip` (none: its
        defaults, a constant learning rate and no clipping)."""
        return {}

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
        replica: int, replicas: int, bucket: bool = False, start: int = 0,
    ) -> Iterator[Batch]:
        """One epoch of this replica's `(inputs, targets)` batches; `batch_size` is the global batch. `start`: the
        global sample of the epoch's order the first batch begins with (a resumed job's position; a multiple of
        `batch_size`); the batches before it are not built. The order depends on `seed` and `epoch`, not on
        `replica` or `replicas`."""

    def batches_from(
        self, dataset: Dataset, batch_size: int, *, seed: int, epoch: int, replica: int, replicas: int,
        bucket: bool = False, start: int = 0,
    ) -> Iterator[Batch]:
        """The shuffled training batches of `epoch` from global sample `start` on: `batches(..., start=start)`,
        or, for a workload that cannot seek (`seeks` False), its epoch with the `start // batch_size` batches
        before the position skipped."""
        kwargs = {"shuffle": True, "seed": seed, "epoch": epoch, "replica": replica, "replicas": replicas,
                  "bucket": bucket}
        if self.seeks:
            return self.batches(dataset, batch_size, start=start, **kwargs)
        return itertools.islice(self.batches(dataset, batch_size, **kwargs), start // batch_size, None)

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


def _takes(method: Callable[..., Any], name: str) -> bool:
    parameters = inspect.signature(method).parameters.values()
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in parameters)


def _takes_seq_len(model: Callable[..., Any]) -> bool:
    return _takes(model, "seq_len")


def _without_seq_len(model: Callable[..., BlockModel]) -> Callable[..., BlockModel]:
    """An old `model(self, preset)` as `model(self, preset, *, seq_len=None)`: a window it cannot take is refused."""

    @functools.wraps(model)
    def with_seq_len(self: Workload, preset: str, *, seq_len: int | None = None) -> BlockModel:
        if seq_len is not None:
            raise _no_window(self.name)
        return model(self, preset)

    del with_seq_len.__wrapped__  # its signature is the new one
    return with_seq_len


def _no_window(name: str) -> ConfigError:
    return ConfigError(f"workload {name!r} has no window to change: --seq-len does not apply",
                       hint="drop --seq-len (the preset sets the length)")

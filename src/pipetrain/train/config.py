"""The job description: `TrainConfig`, a frozen tree (layout, model, data, recipe, durability, logs) checked cheaply on
construction; what needs the model, the data or the machine is checked by `pipetrain.train.prepare`."""

from __future__ import annotations

import functools
import json
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from pipetrain.blocks import BlockModel
from pipetrain.checkpoint.durable import DurableConfig
from pipetrain.config import ParallelConfig
from pipetrain.data.fields import RowFormat
from pipetrain.data.packing import pack_mode
from pipetrain.data.settings import data_digest
from pipetrain.errors import ConfigError
from pipetrain.logs.config import LogConfig
from pipetrain.moe.capacity import check_capacity
from pipetrain.lora import LoraBlocks, LoraSettings
from pipetrain.objectives import DPOSettings, GRPOSettings, GRPOWorkload, PreferenceWorkload
from pipetrain.objectives.preference import check_pair_batches
from pipetrain.objectives.prompt_rows import check_generations
from pipetrain.pipeline.compiled import dynamic_shapes
from pipetrain.pipeline.precision import check_precision
from pipetrain.plan.auto import Fixed
from pipetrain.recipe import RecipeConfig
from pipetrain.train.counts import SYNTHETIC, SYNTHETIC_TEST, SYNTHETIC_TRAIN, check_counts
from pipetrain.workloads.registry import Dataset, DataRequest, Workload, get_workload

__all__ = ["SYNTHETIC", "SYNTHETIC_TRAIN", "SYNTHETIC_TEST", "LayoutRequest", "TrainConfig", "load_data"]

@dataclass(frozen=True, kw_only=True)
class LayoutRequest:
    """What the layout flags leave for `prepare` to choose before any rank starts: with `auto` (`--layout auto`) the
    whole layout, within the choices `fixed` by flags, for `nproc` ranks (None: the launcher's, else a default),
    from the device figures of `calibration`; and the split of `--partition time|memory` from the block costs of
    `profile` (else measured), within `mem_cap` MB per rank; `on_resize` (`--on-resize`) what a job resuming a
    checkpoint of another number of ranks does (`pipetrain.plan.resize`). Empty once prepared: `parallel` then says
    it all."""

    auto: bool = False
    on_resize: str = "stop"
    fixed: Fixed = field(default_factory=Fixed)
    nproc: int | None = None
    calibration: Path | None = None
    profile: Path | None = None
    mem_cap: float | None = None


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training job: the workload and its preset, the data, the optimisation and the parallel layout."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    #: what of the layout is left to choose (`--layout auto`, `--partition time|memory`); see `LayoutRequest`
    layout: LayoutRequest = field(default_factory=LayoutRequest)
    workload: str = "classifier"
    preset: str = "cpu"
    #: a pretrained model folder (`--model DIR`, `Workload.with_model`) and how its text fills windows (`--pack`:
    #: none | windows | documents; True and False, the old spelling, are windows and none)
    model_dir: Path | None = None
    pack: str | bool = "windows"
    #: the fields of JSON lines, Parquet or datasets rows (`--text-field`, `--prompt-field`, `--answer-field`) and
    #: what a row longer than the window does (`--truncate`)
    row_format: RowFormat = field(default_factory=RowFormat)
    #: None: the workload's default data (`Workload.default_data`, else its synthetic corpus); SYNTHETIC: the
    #: synthetic corpus; else a folder/file
    data: Path | str | None = None
    #: sizes of the synthetic corpus (None: SYNTHETIC_TRAIN / SYNTHETIC_TEST); refused for real data
    train_samples: int | None = None
    test_samples: int | None = None
    #: tokens per sample for a workload that `windows` (None: the preset's window for this data)
    seq_len: int | None = None
    batch_size: int = 64
    #: None: the workload's default for this data (`Workload.job_defaults`), or, with `max_steps`, as many as the
    #: steps take (`epochs_of`)
    epochs: int | None = None
    #: the run's length in optimizer steps (the epochs repeat as needed); with `epochs` too, a cap (whichever ends first)
    max_steps: int | None = None
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    seed: int = 0
    #: batches of similar lengths (None: the workload's default for this data, `Workload.job_defaults`)
    bucket: bool | None = None
    progress: bool = True
    trace: Path | None = None
    trace_steps: int = 3
    trace_warmup: int = 2
    precision: str = "fp32"
    #: LoRA adapters through PEFT on a frozen base (`--lora-rank` ...; None: every parameter trains)
    lora: LoraSettings | None = None
    durable: DurableConfig = field(default_factory=DurableConfig)
    logs: LogConfig = field(default_factory=LogConfig)
    #: what a step optimises beyond next-token loss (`--objective dpo`: `DPOSettings`, `grpo`: `GRPOSettings`; None:
    #: the workload's loss)
    objective: DPOSettings | GRPOSettings | None = None
    #: a mixture of experts' expert capacity factor (`--moe-capacity`, `pipetrain.moe.capacity`; None: no token
    #: dropped, as transformers)
    moe_capacity: float | None = None

    def __post_init__(self) -> None:
        """Checks of the description alone (no model is built: `prepare` checks the model against the layout)."""
        if isinstance(self.data, str) and self.data != SYNTHETIC:
            object.__setattr__(self, "data", Path(self.data))
        object.__setattr__(self, "pack", pack_mode(self.pack))
        check_precision(self.precision)
        check_capacity(self.moe_capacity)
        workload = self.task()
        workload.check_preset(self.preset)
        self._check_data(workload)
        for name, value in workload.job_defaults(synthetic=self.synthetic).items():
            if name == "epochs" and self.max_steps is not None:
                continue  # --max-steps alone is the run's length: the epochs follow from it (`epochs_of`)
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.bucket and self.parallel.pipeline.compile:  # lengths vary per batch: compile with symbolic shapes
            object.__setattr__(self, "parallel", dynamic_shapes(self.parallel))
        if self.bucket and not workload.buckets:
            raise ConfigError(f"workload {self.workload!r} has samples of one length: --bucket does not apply",
                              hint="drop --bucket")
        check_counts(batch_size=self.batch_size, epochs=self.epochs, train_samples=self.train_samples,
                     test_samples=self.test_samples, seq_len=self.seq_len, max_steps=self.max_steps)
        self._check_trace()
        self.parallel.check_global_batch(self.batch_size)
        if isinstance(self.objective, DPOSettings):
            check_pair_batches(self.batch_size, self.parallel.dp, self.parallel.pipeline.n_microbatches)
        if isinstance(self.objective, GRPOSettings):
            check_generations(self.batch_size, self.objective.generations, self.parallel.dp)
            if self.objective.loss.kl_beta and self.lora is None:
                raise ConfigError(f"--kl-beta {self.objective.loss.kl_beta} needs a reference model: pipetrain keeps "
                                  "no second copy of the weights", hint="train LoRA adapters (--lora-rank 8): the "
                                                                       "reference is the base with them off; or drop "
                                                                       "--kl-beta")
        if self.logs.sample_every is not None and (self.workload != "hf" or self.model_dir is None):
            raise ConfigError(f"--sample-every generates text with a model folder's tokenizer; this job trains "
                              f"workload {self.workload!r}{' without --model' if self.model_dir is None else ''}",
                              hint="pass --workload hf --model DIR (a Hugging Face folder), or drop --sample-every")

    def _check_data(self, workload: Workload) -> None:
        if not self.synthetic:
            for flag, value in (("--train-samples", self.train_samples), ("--test-samples", self.test_samples)):
                if value is not None:
                    raise ConfigError(f"{flag} {value} sizes the synthetic corpus, but this job trains on "
                                      f"{self.data or workload.default_data}",
                                      hint=f"pass --data {SYNTHETIC} to train on the synthetic corpus, or drop {flag}")
        if self.seq_len is not None and not workload.windows:
            raise ConfigError(f"workload {self.workload!r} has no window to change: --seq-len does not apply",
                              hint="drop --seq-len (the preset sets the length)")

    def _check_trace(self) -> None:
        if self.trace is not None and (self.trace_steps < 1 or self.trace_warmup < 0):
            raise ConfigError(f"--trace with {self.trace_steps} traced step(s) after {self.trace_warmup} warm-up "
                              "step(s) records nothing", hint="pass --trace-steps 1 or more and --trace-warmup 0 or more")
        if self.trace is not None and self.max_steps is not None and self.max_steps <= self.trace_warmup:
            raise ConfigError(f"--trace records no step: --max-steps {self.max_steps} ends within the "
                              f"{self.trace_warmup} warm-up step(s) before tracing",
                              hint=f"pass --max-steps {self.trace_warmup + self.trace_steps} or more, or lower --trace-warmup")

    @property
    def synthetic(self) -> bool:
        """Whether this job trains on the workload's synthetic corpus."""
        return self.data == SYNTHETIC or (self.data is None and self.task().default_data is None)

    @property
    def window(self) -> int | None:
        """Tokens per sample (None for a workload whose preset alone sets it)."""
        return self.task().window(self.preset, seq_len=self.seq_len, synthetic=self.synthetic)

    @property
    def lr(self) -> float:
        """The peak learning rate (`recipe.lr`)."""
        return self.recipe.lr

    def total_steps(self, train: Dataset) -> int:
        """The optimizer steps of the whole run on `train`: `max_steps` when set alone (the run's length), else the
        epochs' batches (or `max_steps` when fewer)."""
        if self.max_steps is not None and self.epochs is None:
            return self.max_steps
        per_epoch = self.task().num_batches(train, self.batch_size, replicas=self.parallel.dp)
        return per_epoch * self.epochs if self.max_steps is None else min(per_epoch * self.epochs, self.max_steps)

    def epochs_of(self, train: Dataset) -> int:
        """The epochs the run goes through on `train`: `epochs`, or (`max_steps` alone) as many as its steps need,
        the last one cut short where the steps end."""
        if self.epochs is not None or self.max_steps is None:
            return self.epochs
        per_epoch = self.task().num_batches(train, self.batch_size, replicas=self.parallel.dp)
        if per_epoch < 1:
            raise ConfigError(f"an epoch of {len(train)} samples holds no global batch of {self.batch_size} over "
                              f"{self.parallel.dp} replica(s): --max-steps {self.max_steps} cannot be trained",
                              hint="give more data or pass a smaller --batch-size")
        return -(-self.max_steps // per_epoch)

    def task(self) -> Workload:
        """The registered workload this job trains (on `model_dir` when set)."""
        workload = get_workload(self.workload)
        workload = workload if self.model_dir is None else workload.with_model(self.model_dir, pack=self.pack)
        if self.objective is not None and self.workload != "hf":
            raise ConfigError(f"--objective {'dpo' if isinstance(self.objective, DPOSettings) else 'grpo'} trains a "
                              f"Hugging Face model folder, not workload {self.workload!r}",
                              hint="pass --workload hf --model DIR --data ROWS.jsonl")
        if isinstance(self.objective, DPOSettings):
            return PreferenceWorkload(workload, self.objective)
        if isinstance(self.objective, GRPOSettings):
            return GRPOWorkload(workload, self.objective)
        return workload

    def model(self) -> BlockModel:
        """The workload's model for this preset and window (a `BlockModel`); with `lora`, its blocks carry PEFT's
        LoRA layers on a frozen base (`LoraBlocks`)."""
        model = self.task().model(self.preset, seq_len=self.window)
        if self.moe_capacity is not None:
            with_capacity = getattr(model, "with_capacity", None)
            if with_capacity is None:
                raise ConfigError(f"--moe-capacity {self.moe_capacity} caps the tokens each expert of a mixture of "
                                  f"experts takes; workload {self.workload!r} has no experts",
                                  hint="drop --moe-capacity, or train a MoE folder (--workload hf --model DIR)")
            model = with_capacity(self.moe_capacity)
        return model if self.lora is None else LoraBlocks(model, self.lora, workload=self.workload)

    def model_name(self) -> str:
        """`workload:preset`, the model a checkpoint of this job belongs to."""
        return f"{self.workload}:{self.preset}"

    def data_digest(self) -> str | None:
        """A digest of the data files and the fields read (None: the workload's default or synthetic data), kept in
        a checkpoint's data position: a resume on changed data is refused (`prepare.check_resumed_data`)."""
        return None if self.synthetic or self.data is None else data_digest(self.data, self.row_format)

    def as_json(self) -> dict:
        """This configuration as JSON data (recorded in checkpoints)."""
        return json.loads(json.dumps(asdict(self), default=str))


def _accept_old_lr(init: Callable[..., None]) -> Callable[..., None]:
    """`TrainConfig(lr=...)`, the spelling before the recipe (deprecated in 0.2): its value becomes `recipe.lr`."""

    @functools.wraps(init)
    def __init__(self, *args: Any, lr: float | None = None, **kwargs: Any) -> None:
        if lr is not None:
            warnings.warn("TrainConfig(lr=) is deprecated: pass recipe=RecipeConfig(lr=...)", DeprecationWarning,
                          stacklevel=2)
            kwargs["recipe"] = replace(kwargs.get("recipe", RecipeConfig()), lr=lr)
        init(self, *args, **kwargs)

    return __init__


TrainConfig.__init__ = _accept_old_lr(TrainConfig.__init__)  # type: ignore[method-assign]


def load_data(config: TrainConfig) -> tuple[Dataset, Dataset]:
    """The job's train and evaluation data: its synthetic corpus, the folder/file `config.data`, or (no data named)
    the workload's default data."""
    synthetic = config.synthetic
    request = DataRequest(preset=config.preset, path=None if synthetic else config.data, synthetic=synthetic,
                          train_samples=config.train_samples or SYNTHETIC_TRAIN,
                          test_samples=config.test_samples or SYNTHETIC_TEST, seed=config.seed, seq_len=config.window,
                          row_format=config.row_format)
    return config.task().load_data(request)

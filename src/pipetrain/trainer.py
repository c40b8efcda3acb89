"""The training loop of the reference workload: a Transformer classifier on IMDB reviews, on one rank of the mesh."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from pipetrain.config import ParallelConfig
from pipetrain.errors import ConfigError
from pipetrain.launch.spawn import RankSpec
from pipetrain.pipeline import PipelineEngine
from pipetrain.session import close_session, open_session
from pipetrain.workloads.imdb import ReviewDataset, batches, load_aclimdb, num_batches, synthetic_imdb
from pipetrain.workloads.transformer import PRESETS, TransformerClassifier

__all__ = ["TrainConfig", "EpochReport", "load_data", "train_rank"]

log = logging.getLogger("pipetrain")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training job: the model preset, the data, the optimisation and the parallel layout."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    preset: str = "cpu"
    data: Path | None = None
    train_samples: int = 6000
    test_samples: int = 2000
    batch_size: int = 64
    epochs: int = 2
    max_steps: int | None = None
    lr: float = 1e-3
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ConfigError(f"unknown preset {self.preset!r}", hint=f"choose one of: {', '.join(PRESETS)}")
        for name in ("batch_size", "epochs", "train_samples", "test_samples"):
            value = getattr(self, name)
            if value < 1:
                raise ConfigError(f"{name} must be positive, got {value}", hint=f"pass a {name} of 1 or more")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"max_steps must be positive, got {self.max_steps}", hint="pass --max-steps 1 or more")
        if self.lr <= 0:
            raise ConfigError(f"learning rate must be positive, got {self.lr}", hint="pass e.g. --lr 1e-3")
        self.parallel.check_global_batch(self.batch_size)
        self.parallel.pipeline.check_blocks(self.model().num_blocks)

    def model(self) -> TransformerClassifier:
        return TransformerClassifier(PRESETS[self.preset])


@dataclass(frozen=True)
class EpochReport:
    """What one epoch measured (global figures, identical on every rank)."""

    epoch: int
    steps: int
    train_loss: float
    train_accuracy: float
    test_loss: float
    test_accuracy: float
    seconds: float
    synthetic: bool

    def line(self, epochs: int) -> str:
        data = "synthetic IMDB-like data" if self.synthetic else "IMDB"
        return (
            f"epoch {self.epoch}/{epochs}  train loss {self.train_loss:.4f} acc {self.train_accuracy:.3f}  "
            f"test loss {self.test_loss:.4f} acc {self.test_accuracy:.3f}  "
            f"time {self.seconds:.1f}s  steps {self.steps}  ({data})"
        )


def load_data(config: TrainConfig) -> tuple[ReviewDataset, ReviewDataset]:
    """The real aclImdb folder when `config.data` is set, else the deterministic synthetic corpus."""
    preset = PRESETS[config.preset]
    if config.data is not None:
        train, test, _ = load_aclimdb(config.data, seq_len=preset.seq_len, vocab_size=preset.vocab_size)
        return train, test
    return synthetic_imdb(
        num_train=config.train_samples,
        num_test=config.test_samples,
        seq_len=preset.seq_len,
        vocab_size=preset.vocab_size,
        seed=config.seed,
    )


def _evaluate(engine: PipelineEngine, test: ReviewDataset, config: TrainConfig, dp_rank: int) -> tuple[float, float]:
    dp = config.parallel.dp
    loss = correct = count = 0.0
    for x, y in batches(test, config.batch_size, shuffle=False, seed=config.seed, epoch=0, replica=dp_rank, replicas=dp):
        result = engine.evaluate(x, y)
        loss += result.loss * result.samples
        correct += (result.accuracy or 0.0) * result.samples
        count += result.samples
    return loss / max(count, 1), correct / max(count, 1)


def train_rank(spec: RankSpec, config: TrainConfig, data: tuple[ReviewDataset, ReviewDataset] | None = None) -> list[EpochReport]:
    """Train on this rank (one of dp × pp); every rank returns the same epoch reports."""
    train, test = data if data is not None else load_data(config)
    session = open_session(spec, config.model(), config.parallel, seed=config.seed)
    try:
        engine, mesh = session.engine, session.mesh
        optimizer = torch.optim.AdamW(engine.parameters(), lr=config.lr)
        dp = config.parallel.dp
        per_epoch = num_batches(train, config.batch_size, replicas=dp)
        if session.is_main:
            log.info(
                "pipetrain: %s | preset %s | dp=%d (%s) x pp=%d | schedule %s, chunks %d, recompute %s | "
                "balance %s | device %s",
                train.source, config.preset, dp, config.parallel.dp_mode, config.parallel.pp,
                config.parallel.pipeline.schedule, config.parallel.pipeline.n_microbatches,
                config.parallel.pipeline.checkpoint, engine.balance, session.device,
            )
        reports, steps = [], 0
        for epoch in range(1, config.epochs + 1):
            start = time.perf_counter()
            loss = correct = count = 0.0
            total = per_epoch if config.max_steps is None else min(per_epoch, config.max_steps - steps)
            stream = batches(train, config.batch_size, shuffle=True, seed=config.seed, epoch=epoch,
                             replica=mesh.dp_rank, replicas=dp)
            bar = tqdm(total=total, desc=f"epoch {epoch}", unit="step", disable=not (session.is_main and config.progress),
                       leave=False, dynamic_ncols=True)
            for (x, y), _ in zip(stream, range(total)):
                optimizer.zero_grad(set_to_none=True)
                result = engine.step(x, y)
                optimizer.step()
                steps += 1
                loss += result.loss * result.samples
                correct += (result.accuracy or 0.0) * result.samples
                count += result.samples
                bar.set_postfix(loss=f"{result.loss:.4f}")
                bar.update()
            bar.close()
            test_loss, test_accuracy = _evaluate(engine, test, config, mesh.dp_rank)
            report = EpochReport(epoch, steps, loss / max(count, 1), correct / max(count, 1), test_loss,
                                 test_accuracy, time.perf_counter() - start, train.synthetic)
            reports.append(report)
            if session.is_main:
                log.info(report.line(config.epochs))
            if config.max_steps is not None and steps >= config.max_steps:
                break
        return reports
    finally:
        close_session()


def report_dicts(reports: list[EpochReport]) -> list[dict]:
    """Epoch reports as plain dicts (for JSON output)."""
    return [asdict(report) for report in reports]

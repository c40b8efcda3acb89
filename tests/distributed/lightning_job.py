"""A LightningModule trained by Lightning's Trainer, on one process or under PipelineStrategy (run as a script).

`python lightning_job.py OUT PP DP EPOCHS [RESUME]`: Lightning's launcher starts PP x DP processes (it runs this
script again for each); every rank writes `OUT/rank<r>.json` (the loss of each step as the callback saw it, the LR
of each step, the logged `train_loss`, the gradient norms), and the checkpoint at the end of each epoch is written to
`OUT/epoch<e>` (a layout-free pipetrain checkpoint). RESUME: a checkpoint to resume from (`fit(ckpt_path=...)`).
The same module trains on one process with `reference()` (the test calls it in its own process).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from pipetrain.lightning import PipelineStrategy, pipeline

SAMPLES, VALIDATION, BATCH, FEATURES, CLASSES = 64, 32, 16, 12, 4
#: clips every step of this job (the gradient norms of its steps are 0.45 to 0.56)
CLIP = 0.3


class Blocks:
    """Five blocks (an MLP with a residual-free tanh body): pp=2 splits them 3 + 2."""

    num_blocks = 5

    def build_block(self, index: int) -> nn.Module:
        return [nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, CLASSES)][index]

    def example_input(self, batch_size: int) -> torch.Tensor:
        return torch.zeros(batch_size, FEATURES)


class Classifier(L.LightningModule):
    """An ordinary LightningModule; its model comes from `pipeline(self, Blocks())`."""

    def __init__(self, batch_size: int = BATCH, *, one_process: bool = False) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.one_process = one_process
        self.model: nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = pipeline(self, Blocks())

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.model(x), y))  # a forward-only pipelined pass

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(SAMPLES, FEATURES, generator=generator)
        y = torch.randint(0, CLASSES, (SAMPLES,), generator=generator)
        data = TensorDataset(x, y)
        # Under a distributed strategy (DDP too) Lightning gives each replica a DistributedSampler that shuffles the
        # training data (seed 0, reshuffled every epoch); one process gets the same order from one of its own
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0) if self.one_process else None
        return DataLoader(data, batch_size=self.batch_size, sampler=sampler)

    def val_dataloader(self):
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(VALIDATION, FEATURES, generator=generator)
        y = torch.randint(0, CLASSES, (VALIDATION,), generator=generator)
        return DataLoader(TensorDataset(x, y), batch_size=self.batch_size)


class Record(L.Callback):
    """What each rank saw: the step's loss, the LR it ran with, the gradient norm before clipping (reference)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.lrs: list[float] = []
        self.logged: list[float] = []
        self.norms: list[float] = []
        self.validation: list[float] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:  # before Lightning clips
        session = getattr(trainer.strategy, "session", None)
        self.norms.append(session.grad_norm() if session is not None else
                          float(torch.nn.utils.get_total_norm([p.grad for p in module.parameters()])))

    def on_validation_epoch_end(self, trainer, module) -> None:
        if not trainer.sanity_checking:
            self.validation.append(float(trainer.callback_metrics["val_loss"]))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))
        self.logged.append(float(trainer.callback_metrics["train_loss"]))


def trainer(out: Path, epochs: int, strategy: PipelineStrategy | None, record: Record) -> L.Trainer:
    saver = L.callbacks.ModelCheckpoint(dirpath=out, filename="epoch{epoch}", auto_insert_metric_name=False,
                                        save_top_k=-1, every_n_epochs=1)
    common = dict(accelerator="cpu", max_epochs=epochs, logger=False, enable_progress_bar=False,
                  enable_model_summary=False, gradient_clip_val=CLIP, callbacks=[record, saver],
                  default_root_dir=out)
    if strategy is None:
        return L.Trainer(devices=1, **common)
    return L.Trainer(devices=strategy.parallel.world_size, strategy=strategy, **common)


def reference(out: Path, epochs: int) -> tuple[Record, dict[str, torch.Tensor]]:
    """The same module trained by Lightning on this one process: what each step saw, and the final weights."""
    torch.manual_seed(0)
    record = Record()
    module = Classifier(one_process=True)
    trainer(out, epochs, None, record).fit(module)
    return record, {k: v.detach().clone() for k, v in module.model.state_dict().items()}


def main(out: Path, pp: int, dp: int, epochs: int, resume: str | None) -> None:
    torch.manual_seed(0)
    record = Record()
    run = trainer(out, epochs, PipelineStrategy(pp=pp, dp=dp, chunks=2), record)
    run.fit(Classifier(batch_size=BATCH // dp), ckpt_path=resume)
    (out / f"rank{run.global_rank}.json").write_text(json.dumps(
        {"losses": record.losses, "lrs": record.lrs, "logged": record.logged, "norms": record.norms,
         "validation": record.validation, "world": run.world_size}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]),
         sys.argv[5] if len(sys.argv) > 5 else None)

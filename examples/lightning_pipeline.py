"""A LightningModule with pipeline parallelism: 2 stages, 4 micro-batches, on the CPU (pip install 'pipetrain[lightning]').

The module is an ordinary LightningModule; the lines that differ say `# pipetrain` (see docs/lightning.md).

    python examples/lightning_pipeline.py           # Lightning starts the 2 ranks itself
    python examples/lightning_pipeline.py --pp 0    # the same module on one process, without the strategy
"""

import argparse

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pipetrain
from pipetrain.lightning import PipelineStrategy, pipeline  # pipetrain


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = None

    def configure_model(self) -> None:
        if self.model is None:  # pipetrain: the layers as blocks; each rank builds only its stage's
            self.model = pipeline(self, pipetrain.ModuleListModel(
                [nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2)],
                example_input=torch.zeros(1, 16)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)  # the pipelined forward and backward of the whole batch
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return [optimizer], [torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=8)]

    def train_dataloader(self):
        x = torch.randn(512, 16, generator=torch.Generator().manual_seed(1))
        return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=32)


class PrintLoss(L.Callback):
    def on_train_epoch_end(self, trainer, module):
        if trainer.is_global_zero:
            print(f"epoch {trainer.current_epoch}: loss {float(trainer.callback_metrics['train_loss']):.4f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--pp", type=int, default=2, help="pipeline ranks (0: one process, no strategy)")
    args = parser.parse_args()
    strategy = PipelineStrategy(pp=args.pp, chunks=4) if args.pp else "auto"  # pipetrain
    trainer = L.Trainer(accelerator="cpu", devices=max(args.pp, 1), strategy=strategy, max_epochs=4,
                        gradient_clip_val=1.0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[PrintLoss()])
    trainer.fit(Classifier())

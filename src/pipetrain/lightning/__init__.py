"""Pipeline parallelism for PyTorch Lightning (`pip install 'pipetrain[lightning]'`): keep the LightningModule and
the Trainer, add `strategy=PipelineStrategy(pp=..., dp=...)` and build the model with `pipeline(self, blocks)` in
`configure_model`. See docs/lightning.md."""

from __future__ import annotations

from pipetrain.lightning.model import PipelinedModel, pipeline
from pipetrain.lightning.strategy import PipelineStrategy

__all__ = ["PipelineStrategy", "PipelinedModel", "pipeline"]

"""Pipeline parallelism: the only package that uses `torch.distributed.pipelining`."""

from pipetrain.pipeline.engine import PipelineEngine, StepResult
from pipetrain.pipeline.loss import IGNORE_INDEX, Loss, SampleMeanLoss, TokenCrossEntropy
from pipetrain.pipeline.runs import Run, plan_runs
from pipetrain.pipeline.recompute import recomputes

__all__ = ["PipelineEngine", "StepResult", "Loss", "SampleMeanLoss", "TokenCrossEntropy", "IGNORE_INDEX", "Run", "plan_runs", "recomputes"]

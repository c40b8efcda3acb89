"""pipetrain: pipeline, data and hybrid parallel training of PyTorch models on torch.distributed."""

from pipetrain.blocks import BlockModel, ModuleListModel, build_sequential
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.errors import ConfigError, DataError, LaunchError, PipetrainError, RankFailedError
from pipetrain.launch.spawn import RankSpec, launch_local
from pipetrain.pipe import Pipe
from pipetrain.pipeline import Loss, PipelineEngine, StepResult, TokenCrossEntropy
from pipetrain.session import Session, close_session, open_session

__version__ = "0.1.0"

__all__ = [
    "BlockModel",
    "ModuleListModel",
    "build_sequential",
    "ParallelConfig",
    "PipelineConfig",
    "ConfigError",
    "DataError",
    "LaunchError",
    "PipetrainError",
    "RankFailedError",
    "RankSpec",
    "launch_local",
    "Pipe",
    "PipelineEngine",
    "StepResult",
    "Loss",
    "TokenCrossEntropy",
    "Session",
    "open_session",
    "close_session",
]

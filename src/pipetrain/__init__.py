"""pipetrain: pipeline, data and hybrid parallel training of PyTorch models on torch.distributed.

The public names load on first use, so that torch-free parts (the planner, `pipetrain plan`) start fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pipetrain.moved import install as _install_moved_paths

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS = {
    "BlockModel": "pipetrain.blocks",
    "ModuleListModel": "pipetrain.blocks",
    "build_sequential": "pipetrain.blocks",
    "ParallelConfig": "pipetrain.config",
    "PipelineConfig": "pipetrain.config",
    "ConfigError": "pipetrain.errors",
    "DataError": "pipetrain.errors",
    "LaunchError": "pipetrain.errors",
    "PipetrainError": "pipetrain.errors",
    "RankFailedError": "pipetrain.errors",
    "NonFiniteError": "pipetrain.errors",
    "RankSpec": "pipetrain.launch.ranks",
    "launch_local": "pipetrain.launch.spawn",
    "Pipe": "pipetrain.pipe",
    "PipelineEngine": "pipetrain.pipeline",
    "StepResult": "pipetrain.pipeline",
    "Loss": "pipetrain.pipeline",
    "TokenCrossEntropy": "pipetrain.pipeline",
    "Recipe": "pipetrain.recipe",
    "RecipeConfig": "pipetrain.recipe",
    "StepOutcome": "pipetrain.recipe",
    "build_optimizer": "pipetrain.recipe",
    "Session": "pipetrain.session",
    "open_session": "pipetrain.session",
    "close_session": "pipetrain.session",
}

__all__ = list(_EXPORTS)

_install_moved_paths()  # the import paths of 0.1 that moved keep working, with a DeprecationWarning

if TYPE_CHECKING:
    from pipetrain.blocks import BlockModel, ModuleListModel, build_sequential
    from pipetrain.config import ParallelConfig, PipelineConfig
    from pipetrain.errors import ConfigError, DataError, LaunchError, NonFiniteError, PipetrainError, RankFailedError
    from pipetrain.launch.ranks import RankSpec
    from pipetrain.launch.spawn import launch_local
    from pipetrain.pipe import Pipe
    from pipetrain.pipeline import Loss, PipelineEngine, StepResult, TokenCrossEntropy
    from pipetrain.recipe import Recipe, RecipeConfig, StepOutcome, build_optimizer
    from pipetrain.session import Session, close_session, open_session


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pipetrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])

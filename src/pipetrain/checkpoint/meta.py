"""What a checkpoint says of the job that wrote it, and whether it fits this one: the engine's layout, the metadata
rank 0 writes beside the shards, the checkpoint a path names, and the checks of its model (name, parameter
fingerprint, the base model of LoRA adapters)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from pipetrain.checkpoint.folders import CheckpointMeta, latest_checkpoint, read_meta
from pipetrain.checkpoint.keys import fingerprint
from pipetrain.errors import ConfigError
from pipetrain.pipeline import PipelineEngine

__all__ = ["engine_layout", "frozen_model", "checkpoint_meta", "find_checkpoint", "check_compatible"]


def engine_layout(engine: PipelineEngine) -> dict[str, Any]:
    """The parallel layout of `engine` as plain data (recorded in a checkpoint; loading does not need it): `dp` the
    data replicas, `cp` the ranks each sequence is cut over (context parallelism; they reduce gradients with the
    data ranks, `engine.dp` counting both)."""
    cp = engine.sequence_split.cp if engine.sequence_split is not None else 1
    return {
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "dp": engine.dp // cp,
        "cp": cp,
        "pp": engine.config.pp,
        "schedule": engine.config.schedule,
        "virtual_stages": engine.config.virtual_stages,
        "balance": list(engine.balance),
        "stage_module": type(engine.modules[0]).__name__,
    }


def frozen_model(model: Any) -> bool:
    """Whether `model`'s job trains adapters on a frozen base (a LoRA `BlockModel`: it has `base_identity`)."""
    return callable(getattr(model, "base_identity", None))


def checkpoint_meta(engine: PipelineEngine, step: int, model_name: str, config: Mapping[str, Any] | None,
                    extras: Mapping[str, Any] | None, *, fingerprint_: str | None = None) -> CheckpointMeta:
    """The metadata rank 0 writes beside the shards (`fingerprint_`: the model's, when already known)."""
    layout = engine_layout(engine)
    extras = dict(extras or {})
    if frozen_model(engine.model):  # adapters only: the base they adapt, checked on resume and export
        extras["base"] = engine.model.base_identity()
    return CheckpointMeta(step=step, model=model_name, fingerprint=fingerprint_ or fingerprint(engine.model),
                          layout=layout, world_size=layout["world_size"], config=dict(config or {}),
                          extras=extras)


def find_checkpoint(path: str | Path) -> Path:
    """`path` itself when it is a committed checkpoint, else the latest one inside it; ConfigError if none."""
    path = Path(path)
    if _read_meta_or_none(path) is not None:
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        what = "no complete checkpoint in" if path.is_dir() else "no such checkpoint or folder:"
        raise ConfigError(f"{what} {str(path)!r}",
                          hint="pass a step-NNNNNNNN folder or the --save-dir holding them (train once with "
                               "--save-dir to write one), or drop --resume to start afresh")
    return latest


def _read_meta_or_none(folder: Path) -> CheckpointMeta | None:
    return read_meta(folder) if (folder / "pipetrain.json").is_file() else None


def check_compatible(meta: CheckpointMeta, folder: Path, *, model_name: str | None, fingerprint_: str,
                     model: Any = None) -> None:
    """ConfigError when the checkpoint in `folder` was written for another model than this job's (for adapters,
    `model` a LoRA `BlockModel`: another base model than the one they were trained on)."""
    saved = meta.extras.get("base")
    if saved is not None and frozen_model(model):
        current = model.base_identity(saved.get("method", "edges"))  # an older checkpoint: by its own method
        if saved.get("digest") != current.get("digest"):
            where = saved.get("folder") or "a preset's config"
            now = current.get("folder") or "a preset's config"
            raise ConfigError(f"checkpoint {str(folder)!r} holds LoRA adapters of the base model {where} (digest "
                              f"{str(saved.get('digest'))[:12]}), but this job's base is {now} (digest "
                              f"{str(current.get('digest'))[:12]}): its config or weights differ",
                              hint=f"pass --model {where} (the base the adapters were trained on), or another "
                                   "--save-dir to start afresh")
    if model_name is not None and meta.model != model_name:
        raise ConfigError(f"checkpoint {str(folder)!r} was written for model {meta.model!r}, this job trains {model_name!r}",
                          hint="resume with the same workload and preset, or pass another --save-dir")
    if meta.fingerprint != fingerprint_:
        raise ConfigError(f"checkpoint {str(folder)!r} holds parameters of another shape than this model's",
                          hint="resume with the model configuration that wrote it, or pass another --save-dir")

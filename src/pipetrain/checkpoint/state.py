"""Save and load one engine's training state with torch.distributed.checkpoint, under layout-free keys, atomically."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from pipetrain.checkpoint.folders import (
    CheckpointMeta,
    commit,
    damaged_hint,
    final_folder,
    partial_folder,
    prune,
    read_meta,
    write_meta,
)
from pipetrain.checkpoint.experts import expert_slices, fsdp_layouts, fsdp_shards, local_experts, shard_experts
from pipetrain.checkpoint.keys import StageNames, fingerprint
from pipetrain.checkpoint.meta import check_compatible, checkpoint_meta, engine_layout, find_checkpoint, frozen_model
from pipetrain.checkpoint.rng import restore_rng, rng_state, rng_targets
from pipetrain.checkpoint.save_errors import failure_text, save_failed
from pipetrain.checkpoint.strided import full_targets, gather_strided
from pipetrain.errors import CheckpointError
from pipetrain.pipeline import PipelineEngine
from pipetrain.pipeline.tied import tied_aliases

__all__ = ["save_checkpoint", "load_checkpoint", "find_checkpoint", "engine_layout"]
# also importable from here, as before their modules: checkpoint_meta, check_compatible, frozen_model, save_failed

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _model_options(engine: PipelineEngine) -> StateDictOptions:
    """A LoRA engine's model state is its adapters: the frozen base is the base folder's, neither saved nor loaded."""
    frozen = frozen_model(engine.model)
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def _states(engine: PipelineEngine,
            optimizer: torch.optim.Optimizer | None) -> tuple[nn.Module, StageNames, dict, dict]:
    """(container of the stage modules, its key renamer, this rank's layout-free state dict, and the FSDP2 layout of
    each expert slice in it: `checkpoint.experts.fsdp_layouts`, to shard them again after a load)."""
    container = nn.ModuleList(engine.modules)
    mesh = getattr(engine, "expert_mesh", None)
    slices = expert_slices(container, _clean) if mesh is not None else {}
    names = StageNames(engine.stage_ids, engine.balance, tied_aliases(engine.model, engine.model.num_blocks))
    model = get_model_state_dict(container, options=_model_options(engine))
    layouts: dict[str, Any] = {}
    if slices:  # expert-parallel slices written as their rows of the whole tensor (see checkpoint.experts)
        layouts.update({f"model.{k}": v for k, v in names.model_state(fsdp_layouts(model, slices, mesh, _clean)).items()})
        model = shard_experts(model, slices, mesh, _clean)
    if frozen_model(engine.model):  # the base's buffers (rotary tables, masks) are rebuilt from the base folder
        trained = {_clean(n) for n, p in container.named_parameters() if p.requires_grad}
        model = {k: v for k, v in model.items() if _clean(k) in trained}
    state: dict[str, Any] = {f"model.{k}": v for k, v in names.model_state(model).items()}
    if _holds_parameters(optimizer):  # a LoRA stage of frozen blocks only has an empty optimizer: nothing to save
        optim = get_optimizer_state_dict(container, optimizer, options=_OPTIONS)
        if slices:
            layouts.update({f"optim.{k}": v for k, v in names.optimizer_state(
                fsdp_layouts(optim, slices, mesh, _clean, optimizer=True)).items()})
            optim = shard_experts(optim, slices, mesh, _clean, optimizer=True)
        state.update({f"optim.{k}": v for k, v in names.optimizer_state(optim).items()})
    return container, names, state, layouts


def _holds_parameters(optimizer: torch.optim.Optimizer | None) -> bool:
    return optimizer is not None and any(group["params"] for group in optimizer.param_groups)


def _clean(key: str) -> str:
    """A parameter name with the wrappers' prefixes (DDP's `module.`, recomputation's, compile's) removed, as the
    state dict helpers name it."""
    return ".".join(part for part in key.split(".") if part not in ("module", "_orig_mod", "_checkpoint_wrapped_module"))


def _agree(error: str | None) -> None:
    """Raise CheckpointError on every rank when rank 0 reports `error` (its value elsewhere is ignored)."""
    box = [error]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise CheckpointError(box[0], hint="free space or pass a --save-dir you can write to; "
                                           "the previous checkpoints are intact")


def save_checkpoint(
    directory: str | Path,
    engine: PipelineEngine,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int,
    model_name: str = "model",
    config: Mapping[str, Any] | None = None,
    extras: Mapping[str, Any] | None = None,
    keep: int | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> Path:
    """Write the checkpoint of `step` into `directory` from every rank (a collective call); returns its folder.

    Every rank writes its own shards with DCP into `step-NNNNNNNN.partial`; after all have written, rank 0
    writes the metadata and renames the folder to `step-NNNNNNNN`: the checkpoint is visible only once
    complete. Left-over partial folders and checkpoints beyond the `keep` newest are then removed. `extras`
    (JSON-serialisable) come back from `load_checkpoint`. `process_group`: the group DCP's own collectives run on
    (None: the default one), e.g. one whose timeout allows a long write.
    """
    partial, final = begin_save(Path(directory), step)
    try:
        dcp.save(saved_state(engine, optimizer), checkpoint_id=str(partial), process_group=process_group)
    except (Exception, dcp.CheckpointException) as err:  # DCP raises the same CheckpointException on every rank
        raise save_failed(final, err) from None
    meta = checkpoint_meta(engine, step, model_name, config, extras) if _rank() == 0 else None
    _agree(commit_save(partial, final, meta, keep) if meta is not None else None)
    return final


def begin_save(directory: Path, step: int) -> tuple[Path, Path]:
    """Before any rank writes the checkpoint of `step` (a collective call): rank 0 makes `directory` and removes a
    partial folder a killed job left; returns (the partial folder to write, the folder it is committed to)."""
    error = None
    if _rank() == 0:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            prune(directory, keep=None)  # a partial folder of this step left by a killed job
        except OSError as err:
            error = f"cannot write checkpoints to {str(directory)!r}: {err}"
    _agree(error)
    return partial_folder(directory, step), final_folder(directory, step)


def saved_state(engine: PipelineEngine, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """What this rank writes: its model (and optimizer) state under layout-free keys, and its RNG state."""
    _, _, state, _ = _states(engine, optimizer)
    state = gather_strided(state)  # tensor-parallel fused q, k, v: saved whole (see checkpoint.strided)
    state.update(rng_state(_rank()))
    return state


def commit_save(partial: Path, final: Path, meta: CheckpointMeta, keep: int | None) -> str | None:
    """On rank 0, once every rank's shards are in `partial`: write the metadata, commit, prune older
    checkpoints beyond `keep`. Returns what went wrong, or None."""
    try:
        write_meta(partial, meta)
        commit(partial, final)
        prune(final.parent, keep=keep)
    except OSError as err:
        return f"could not commit checkpoint {str(final)!r}: {err}"
    return None


def load_checkpoint(
    path: str | Path,
    engine: PipelineEngine,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    model_name: str | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> CheckpointMeta:
    """Load a checkpoint (a `step-N` folder, or the latest in a folder) into `engine` and `optimizer`.

    A collective call; works under any layout. The RNG states are restored only under the layout that
    wrote the checkpoint (elsewhere each rank's random stream differs anyway). Raises ConfigError when the
    checkpoint belongs to another model (`model_name` and the parameter fingerprint are compared).
    `process_group`: the group DCP's own collectives run on (None: the default one).
    """
    folder = find_checkpoint(path)
    meta = read_meta(folder)
    check_compatible(meta, folder, model_name=model_name, fingerprint_=fingerprint(engine.model), model=engine.model)
    container, names, state, layouts = _states(engine, optimizer)
    state, split = full_targets(state)
    same_layout = meta.layout == engine_layout(engine)
    if same_layout:
        state.update(rng_targets(_rank(), saved_keys(folder)))
    try:
        dcp.load(state, checkpoint_id=str(folder), process_group=process_group)
    except (Exception, dcp.CheckpointException) as err:
        raise CheckpointError(f"could not read checkpoint {str(folder)!r}: {failure_text(err)}",
                              hint=damaged_hint(folder)) from None
    state = split(state)
    if getattr(engine, "expert_mesh", None) is not None:
        state = fsdp_shards(local_experts(state, engine.expert_mesh), layouts)
    model_state = {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}
    set_model_state_dict(container, names.local_model_state(model_state), options=_model_options(engine))
    if _holds_parameters(optimizer):
        optim = {k[len("optim."):]: v for k, v in state.items() if k.startswith("optim.")}
        set_optimizer_state_dict(container, optimizer, names.local_optimizer_state(optim), options=_OPTIONS)
    if same_layout:
        restore_rng(state, _rank())
    _barrier()
    return meta


def saved_keys(folder: Path) -> set[str]:
    """The keys a committed checkpoint holds (from DCP's metadata; empty when it cannot be read)."""
    try:
        return set(dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata)
    except Exception:  # a damaged checkpoint: dcp.load reports it with its hint
        return set()

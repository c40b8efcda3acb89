"""`prepare`: every check of a job that can fail before its ranks start, made once, by the spawning process and by
each launched rank alike; it settles what the flags left open (the layout, the window) with `dataclasses.replace`
and returns the final, frozen description with the loaded data."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from pipetrain.checkpoint.folders import read_meta
from pipetrain.checkpoint.keys import fingerprint
from pipetrain.checkpoint.state import find_checkpoint
from pipetrain.context import check_context
from pipetrain.errors import ConfigError
from pipetrain.launch.device import check_local_ranks
from pipetrain.launch.env import ClusterEnv
from pipetrain.logs.config import check_log_folders, check_metrics_file
from pipetrain.moe.split import check_expert_parallel
from pipetrain.parallel.tensor import check_tensor_parallel
from pipetrain.plan.resize import Saved, decide
from pipetrain.trace.files import check_trace_dir
from pipetrain.train.config import LayoutRequest, TrainConfig, load_data
from pipetrain.train.layout import Calibrate, auto_layout, balanced, check_resize_files
from pipetrain.workloads.registry import Dataset

__all__ = ["Prepared", "prepare", "resumed", "settled", "check_model", "check_trace", "check_resumed_data"]

log = logging.getLogger("pipetrain")


@dataclass(frozen=True)
class Prepared:
    """A job ready to start: its final description and its (train, evaluation) data."""

    config: TrainConfig
    data: tuple[Dataset, Dataset]


def check_model(config: TrainConfig) -> None:
    """The model against the layout: enough blocks for the stages, a tensor-parallel plan that splits it, experts
    that `--ep` divides."""
    model = config.model()
    config.parallel.pipeline.check_blocks(model.num_blocks)
    check_tensor_parallel(model, config.parallel.tp, sequence_parallel=config.parallel.sequence_parallel,
                          loss_parallel=config.parallel.loss_parallel)
    check_context(model, config.parallel.cp, config.parallel.cp_attention, config.seq_len, config.parallel.tp,
                  sequence_parallel=config.parallel.sequence_parallel)
    check_expert_parallel(model, config.parallel.ep, dp_mode=config.parallel.dp_mode)


def settled(config: TrainConfig) -> TrainConfig:
    """`config` with the window its data gives written out as `seq_len` (epochs and bucketing are settled on
    construction), its model checked against its layout: what `--print-config` says, without the machine."""
    window = config.window
    if window is not None and config.seq_len != window:
        config = replace(config, seq_len=window)
    check_model(config)
    return config


def check_trace(config: TrainConfig, train: Dataset) -> None:
    """Fail before training when `--trace` cannot write its folder or would record no step."""
    if config.trace is None:
        return
    check_trace_dir(config.trace)
    total = config.total_steps(train)
    if total <= config.trace_warmup:
        raise ConfigError(f"--trace records no step: the run has {total} step(s), all within the "
                          f"{config.trace_warmup} warm-up step(s)",
                          hint="train more steps (more samples, --epochs) or lower --trace-warmup")


def _auto_world(config: TrainConfig, env: ClusterEnv | None, job: ClusterEnv | None, device: str) -> tuple[int, int]:
    """The ranks `--layout auto` lays out, and how many of them share a node."""
    nproc, fixed = config.layout.nproc, config.layout.fixed
    if job is not None:
        if nproc is not None:
            raise ConfigError("--nproc is for a job this command spawns, not ranks started by a launcher",
                              hint="drop --nproc: the launcher's world size is used")
        return job.world_size, job.local_world_size
    if nproc is not None:
        if nproc < 1:
            raise ConfigError(f"--nproc must be 1 or more, got {nproc}", hint="pass --nproc 2, for example")
        world = nproc
    elif fixed.pp is not None or fixed.dp is not None:
        world = (fixed.pp or 1) * (fixed.dp or 1)
    elif device == "cuda":
        import torch

        world = max(1, torch.cuda.device_count())
    else:
        world = 2
    return world, world


def resumed(config: TrainConfig) -> Saved | None:
    """The checkpoint a `--resume` job goes on from, as `plan.resize` reads it; None without --resume."""
    if not config.durable.resume:
        return None
    folder = find_checkpoint(config.durable.resume_path)
    meta = read_meta(folder)
    return Saved.from_meta(str(folder), step=meta.step, model=meta.model, fingerprint=meta.fingerprint,
                           layout=meta.layout, config=meta.config, world_size=meta.world_size)


def check_resumed_data(config: TrainConfig) -> None:
    """With --resume: one ConfigError when the checkpoint's data position was saved on other data than `--data`
    (rows appended, removed or changed shift the order: the saved position would skip or repeat samples)."""
    if not config.durable.resume:
        return
    folder = find_checkpoint(config.durable.resume_path)
    meta = read_meta(folder)
    saved = meta.extras.get("position", {}).get("data")
    now = config.data_digest() if saved is not None else None
    if saved is None or now is None or saved == now:
        return
    was = meta.config.get("data")
    raise ConfigError(f"--data {str(config.data)!r} is not the data checkpoint {str(folder)!r} was saved on"
                      f"{f' (--data {was!r})' if was else ''}: its content or fields changed since (digest {saved[:12]} "
                      f"then, {now[:12]} now), so its saved position would skip or repeat samples",
                      hint="resume with the data the run trained on, or start a new run (another --save-dir) on the "
                           "new data, from the checkpoint's weights: pipetrain export --hf, then --model OUT")


def _laid_out(config: TrainConfig, env: ClusterEnv | None, job: ClusterEnv | None, device: str, main: bool,
              calibrate: Calibrate | None) -> TrainConfig:
    """`config` with its layout for the ranks there are: `--layout auto`'s choice; under `--on-resize auto`, the
    planner's for launched ranks the layout flags do not make up (a torchrun elastic or Slurm restart with fewer or
    more nodes); under `--on-resize stop`, one message when those ranks differ from the checkpoint's."""
    request = config.layout
    saved = resumed(config)
    if request.auto:
        world, per_node = _auto_world(config, env, job, device)
        return auto_layout(config, world=world, per_node=per_node, device=device, launched=env is not None,
                           say=main, calibrate=calibrate, saved=saved)
    if env is not None:
        check_resize_files(config)
    if job is None or job.world_size == config.parallel.world_size:
        return config  # the layout as given (a deliberate change of layout resumes as before)
    if request.on_resize == "auto":
        if main:
            log.info("pipetrain: --on-resize auto: the job has %d ranks, the layout flags make %d: the planner lays "
                     "them out", job.world_size, config.parallel.world_size)
        return auto_layout(replace(config, layout=replace(request, auto=True)), world=job.world_size,
                           per_node=job.local_world_size, device=device, launched=True, say=main, calibrate=calibrate,
                           saved=saved)
    if saved is not None:  # --on-resize stop: say what changed since the checkpoint (else check_world says it)
        decide(saved, world=job.world_size, policy=request.on_resize, model=config.model_name(),
               fingerprint=fingerprint(config.model()), choose=lambda ranks: None)
    return config


def prepare(config: TrainConfig, *, device: str, env: ClusterEnv | None = None, ranks: list[ClusterEnv] | None = None,
            calibrate: Calibrate | None = None, render: Callable[[TrainConfig], str] | None = None) -> Prepared:
    """Check the job `config` on `device` and settle it: the layout (`--layout auto`, then `--partition
    time|memory`), the window, the model against the layout, the ranks, the files it writes, the data and the
    steps. `env`: the launcher's ranks (None: this process spawns them all here); `ranks`: the ranks this task
    spawns on its node (`--ranks-per-node`). Rank 0 (or the spawner) says the choices and checks the files it
    alone writes. `calibrate` measures this machine for `--layout auto` when no calibration is stored; `render`
    writes the final description as the run folder's config.toml."""
    job = ranks[0] if ranks else env
    main = env is None or env.rank == 0
    config = _laid_out(config, env, job, device, main, calibrate)
    config = balanced(settled(config), device=device, launched=env is not None, say=main)
    if job is None:
        check_local_ranks(config.parallel.world_size, device)  # the ranks about to be spawned here
    else:
        config.parallel.check_world(job.world_size)
        config.parallel.check_nodes(job.local_world_size)  # TP within a node
    if main:  # the process that writes the metrics file and the trace, and commits checkpoints
        check_metrics_file(config.logs.metrics)
        config.durable.check(model_name=config.model_name(), model=config.model(), batch_size=config.batch_size)
        check_log_folders(config.logs)
    if main:
        check_resumed_data(config)
    data = load_data(config)
    config.recipe.check_run(config.total_steps(data[0]))
    if main:
        check_trace(config, data[0])
    config = replace(config, layout=LayoutRequest())  # all settled: `parallel` says the layout
    if render is not None:
        config = replace(config, logs=replace(config.logs, config_text=render(config)))
    return Prepared(config, data)

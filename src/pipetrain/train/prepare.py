"""`prepare`: every check of a job that can fail before its ranks start, made once, by the spawning process and by
each launched rank alike; it settles what the flags left open (the layout, the window) with `dataclasses.replace`
and returns the final, frozen description with the loaded data."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from pipetrain.errors import ConfigError
from pipetrain.launch.device import check_local_ranks
from pipetrain.launch.env import ClusterEnv
from pipetrain.logs.config import check_log_folders, check_metrics_file
from pipetrain.parallel.tensor import check_tensor_parallel
from pipetrain.trace.files import check_trace_dir
from pipetrain.train.config import LayoutRequest, TrainConfig, load_data
from pipetrain.train.layout import Calibrate, auto_layout, balanced
from pipetrain.workloads.registry import Dataset

__all__ = ["Prepared", "prepare", "settled", "check_model", "check_trace"]


@dataclass(frozen=True)
class Prepared:
    """A job ready to start: its final description and its (train, evaluation) data."""

    config: TrainConfig
    data: tuple[Dataset, Dataset]


def check_model(config: TrainConfig) -> None:
    """The model against the layout: enough blocks for the stages, and a tensor-parallel plan that splits it."""
    model = config.model()
    config.parallel.pipeline.check_blocks(model.num_blocks)
    check_tensor_parallel(model, config.parallel.tp, sequence_parallel=config.parallel.sequence_parallel,
                          loss_parallel=config.parallel.loss_parallel)


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
    if config.layout.auto:
        world, per_node = _auto_world(config, env, job, device)
        config = auto_layout(config, world=world, per_node=per_node, device=device, launched=env is not None,
                             say=main, calibrate=calibrate)
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
    data = load_data(config)
    config.recipe.check_run(config.total_steps(data[0]))
    if main:
        check_trace(config, data[0])
    config = replace(config, layout=LayoutRequest())  # all settled: `parallel` says the layout
    if render is not None:
        config = replace(config, logs=replace(config.logs, config_text=render(config)))
    return Prepared(config, data)

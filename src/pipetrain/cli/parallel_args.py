"""The parallelism flags shared by `train`, `check` and the other verbs that build a mesh: --pp, --dp, --schedule …"""

from __future__ import annotations

import argparse
import logging
from dataclasses import replace
from pathlib import Path

from pipetrain.cli.device_args import device_choice
from pipetrain.config import CHECKPOINT_POLICIES, DP_MODES, PARTITION_METHODS, SCHEDULES, ParallelConfig, PipelineConfig
from pipetrain.errors import ConfigError
from pipetrain.partition import cost_balance
from pipetrain.partition.profile import load_profile
from pipetrain.partition.stagecost import COST_METHODS, check_mem_cap
from pipetrain.pipeline.runs import plan_runs
from pipetrain.train.loop import TrainConfig

__all__ = ["add_parallel_arguments", "parallel_config", "cost_balanced"]

log = logging.getLogger("pipetrain")


def _balance(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"balance must be comma-separated block counts like 3,5, got {text!r}") from None


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """The mesh and pipeline flags shared by the verbs that train."""
    group = parser.add_argument_group("parallelism")
    group.add_argument("--pp", type=int, default=2, help="pipeline ranks (stages) (default: 2)")
    group.add_argument("--dp", type=int, default=1, help="data-parallel replicas (default: 1)")
    group.add_argument("--dp-mode", default="ddp", help=f"{' | '.join(DP_MODES)} (default: ddp)")
    group.add_argument("--tp", type=int, default=1,
                       help="tensor-parallel ranks splitting each layer (innermost: within one node; with --dp > 1 "
                            "use --dp-mode fsdp) (default: 1)")
    group.add_argument("--sequence-parallel", action="store_true",
                       help="with --tp: also split the norm and dropout regions along the sequence (the sequence "
                            "length, and every --bucket length, a multiple of tp)")
    group.add_argument("--loss-parallel", action="store_true",
                       help="with --tp, for the lm: split the head over the vocabulary and compute the cross-entropy "
                            "on the shards (the vocabulary a multiple of tp)")
    group.add_argument("--schedule", default="1f1b", help=f"{' | '.join(SCHEDULES)} (default: 1f1b)")
    group.add_argument("--chunks", "--n-microbatches", dest="chunks", type=int, default=4,
                       help="micro-batches per batch; 1 is naive model parallelism (default: 4)")
    group.add_argument("--checkpoint", default="never",
                       help=f"activation recomputation: {' | '.join(CHECKPOINT_POLICIES)} (default: never)")
    group.add_argument("--stages-per-rank", type=int, default=None, help="virtual stages per rank (interleaved schedules)")
    group.add_argument("--balance", type=_balance, default=None, help="blocks per stage, e.g. 3,5")
    group.add_argument("--partition", default=None,
                       help=f"split without --balance: {' | '.join(PARTITION_METHODS)} (default: uniform; time "
                            "with --mem-cap); time and memory use measured per-block costs")
    group.add_argument("--mem-cap", type=float, default=None, metavar="MB",
                       help="with --partition time: the fastest balance whose predicted memory per rank fits MB")
    group.add_argument("--profile", type=Path, default=None, metavar="FILE",
                       help="per-block costs for --partition time|memory (from `pipetrain profile`); "
                            "default: measure the blocks at start")
    group.add_argument("--shape-cache", type=int, default=16,
                       help="schedules kept, one per micro-batch shape (sequence length); least recently used "
                            "dropped (default: 16)")
    group.add_argument("--compile", action="store_true",
                       help="torch.compile each block of each stage (regional; dynamic shapes with --bucket); the "
                            "first steps compile (on CPU with the C++ compiler); not with zero-bubble, zbv, dualpipev")


def parallel_config(args: argparse.Namespace) -> ParallelConfig:
    """The validated mesh configuration of parsed arguments."""
    pipeline = PipelineConfig(
        pp=args.pp,
        schedule=args.schedule,
        n_microbatches=args.chunks,
        checkpoint=args.checkpoint,
        stages_per_rank=args.stages_per_rank,
        balance=args.balance,
        partition=args.partition or ("time" if args.mem_cap is not None else "uniform"),
        shape_cache=args.shape_cache,
        compile=getattr(args, "compile", False),
    )
    return ParallelConfig(dp=args.dp, dp_mode=args.dp_mode, pipeline=pipeline, tp=getattr(args, "tp", 1),
                          sequence_parallel=getattr(args, "sequence_parallel", False),
                          loss_parallel=getattr(args, "loss_parallel", False))


def cost_balanced(config: TrainConfig, args: argparse.Namespace, *, launched: bool, say: bool = True) -> TrainConfig:
    """`config` with the balance `--partition time|memory` (and `--mem-cap`) chooses from measured block costs.

    Costs come from `--profile`, else the blocks are measured here (not on a launched rank: every rank
    must split the model the same way, so ranks started by torchrun or srun need `--profile`).
    """
    pipeline = config.parallel.pipeline
    if pipeline.partition not in COST_METHODS:
        for flag, value in (("--mem-cap", args.mem_cap), ("--profile", args.profile)):
            if value is not None:
                raise ConfigError(f"{flag} is only used by --partition time|memory, not {pipeline.partition!r}",
                                  hint=f"add --partition time, or drop {flag}")
        return config
    if pipeline.balance is not None:
        raise ConfigError(f"--balance {','.join(map(str, pipeline.balance))} and --partition {pipeline.partition} "
                          "both choose the split", hint="pass one of them")
    if args.profile is None and launched:
        raise ConfigError(f"--partition {pipeline.partition} on ranks started by a launcher needs --profile FILE "
                          "(each rank measuring on its own could split the model differently)",
                          hint="write one first with `pipetrain profile --output FILE` and pass --profile FILE")
    check_mem_cap(pipeline.partition, args.mem_cap)
    profile = load_profile(args.profile) if args.profile is not None else None
    micro = plan_runs(config.batch_size // config.parallel.dp, pipeline.n_microbatches)[0].size
    if say and profile is None:
        log.info("pipetrain: measuring each block at micro-batch size %d for --partition %s "
                 "(pass --profile FILE to reuse a profile)", micro, pipeline.partition)
    pipeline, choice = cost_balance(config.model(), pipeline, micro_batch_size=micro, profile=profile,
                                    mem_cap_mb=args.mem_cap, profile_source=f"the profile {str(args.profile)!r}",
                                    device=device_choice(args) if profile is None else "cpu")  # the job's device
    if say:
        for line in choice.lines():
            log.info("pipetrain: %s", line)
    return replace(config, parallel=replace(config.parallel, pipeline=pipeline))

"""The parallelism flags shared by `train`, `check` and the other verbs that build a mesh: --pp, --dp, --schedule …"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from pipetrain.cli.device_args import device_choice
from pipetrain.config import (CHECKPOINT_POLICIES, CP_ATTENTIONS, DP_MODES, FSDP_RESHARD, PARTITION_METHODS,
                              RECOMPUTE_UNITS, SCHEDULES, SELECTIVE_MATMULS, ParallelConfig, PipelineConfig)
from pipetrain.errors import ConfigError
from pipetrain.plan.transformer import load_sizes

if TYPE_CHECKING:
    from pipetrain.train.config import TrainConfig

__all__ = ["add_parallel_arguments", "parallel_config", "cost_balanced", "reshard_value", "recomputation"]


def _balance(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"balance must be comma-separated block counts like 3,5, got {text!r}") from None


def reshard_value(text: str) -> str | int:
    """`--fsdp-reshard`: a word of `FSDP_RESHARD`, or a group size N (an int)."""
    return int(text) if text.strip().isdigit() else text


def recomputation(checkpoint: str, unit: str | None) -> tuple[str, str]:
    """(checkpoint policy, recomputation unit) of `--checkpoint` and `--recompute-unit`: `--checkpoint selective` is
    shorthand for `--checkpoint always --recompute-unit selective`."""
    if checkpoint == "selective":
        if unit not in (None, "selective"):
            raise ConfigError(f"--checkpoint selective with --recompute-unit {unit}: selective is a unit itself",
                              hint=f"pass --checkpoint always --recompute-unit {unit}, or drop --recompute-unit")
        return "always", "selective"
    return checkpoint, unit or "stage"


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """The mesh and pipeline flags shared by the verbs that train."""
    group = parser.add_argument_group("parallelism")
    group.add_argument("--pp", type=int, default=2, help="pipeline ranks (stages) (default: 2)")
    group.add_argument("--dp", type=int, default=1, help="data-parallel replicas (default: 1)")
    group.add_argument("--dp-mode", default="ddp",
                       help=f"{' | '.join(DP_MODES)} (default: ddp); hsdp: FSDP2 shards within groups of --dp-shard "
                            "ranks and replicates across the groups")
    group.add_argument("--dp-shard", type=int, default=None, metavar="K",
                       help="with --dp-mode hsdp: ranks of one shard group (a divisor of --dp, e.g. a node's GPUs)")
    group.add_argument("--fsdp-reshard", type=reshard_value, default="never", metavar="|".join(FSDP_RESHARD) + "|N",
                       help="with --dp-mode fsdp/hsdp: free each block's gathered weights after its forward (always), "
                            "keep them to the backward (never), reshard to groups of N ranks, or auto (at pp 1 "
                            "always, in a pipeline never); resharding also reduces each micro-batch's gradients at "
                            "once, so they accumulate sharded (default: never)")
    group.add_argument("--tp", type=int, default=1,
                       help="tensor-parallel ranks splitting each layer (innermost: within one node; with --dp > 1 "
                            "use --dp-mode fsdp) (default: 1)")
    group.add_argument("--ep", type=int, default=1,
                       help="expert-parallel ranks: each MoE layer's experts split over this many of a stage's "
                            "--dp ranks (a divisor of --dp and of the experts; docs/moe-ep.md) (default: 1)")
    group.add_argument("--moe-overlap", choices=("on", "off"), default="off",
                       help="with --ep and --schedule dualpipev: run each fused forward-and-backward action's two "
                            "halves at once (two threads), one micro-batch's expert all-to-all beside the other's "
                            "computation (docs/moe.md: not measurably faster on CPU) (default: off)")
    group.add_argument("--sequence-parallel", action="store_true",
                       help="with --tp: also split the norm and dropout regions along the sequence (the sequence "
                            "length, and every --bucket length, a multiple of tp)")
    group.add_argument("--loss-parallel", action="store_true",
                       help="with --tp, for the lm and hf workloads: split the head (hf: and the embedding, tied or "
                            "not) over the vocabulary and compute the cross-entropy on the shards (the vocabulary a "
                            "multiple of tp)")
    group.add_argument("--cp", type=int, default=1,
                       help="context-parallel ranks cutting each sequence (zig-zag: its length a multiple of 2 x cp; "
                            "the hf workload) (default: 1)")
    group.add_argument("--cp-attention", default="ring", choices=CP_ATTENTIONS,
                       help="with --cp: ring (key/value blocks passed round the ranks, any cp) or ulysses (one "
                            "all-to-all to split the heads: query and key/value heads divisible by cp) (default: ring)")
    group.add_argument("--schedule", default="1f1b", help=f"{' | '.join(SCHEDULES)} (default: 1f1b)")
    group.add_argument("--chunks", "--n-microbatches", dest="chunks", type=int, default=4,
                       help="micro-batches per batch; 1 is naive model parallelism (default: 4)")
    group.add_argument("--checkpoint", default="never",
                       help=f"activation recomputation: {' | '.join(CHECKPOINT_POLICIES)} | selective (always, "
                            "with --recompute-unit selective) (default: never)")
    group.add_argument("--recompute-unit", default=None,
                       help=f"what a recomputing micro-batch checkpoints: {' | '.join(RECOMPUTE_UNITS)} (the whole "
                            "stage; each block; each block keeping its matrix products and attention) (default: stage)")
    group.add_argument("--recompute-every", type=int, default=1, metavar="K",
                       help="with --recompute-unit layer|selective: recompute only every K-th block (default: 1)")
    group.add_argument("--selective-matmuls", choices=SELECTIVE_MATMULS, default="all",
                       help="with selective recomputation: the matrix products each block keeps, all or every other "
                            "one (alternate: torchtitan's op-level policy, less memory, some products run again) "
                            "(default: all)")
    group.add_argument("--offload-activations", action="store_true",
                       help="move saved activations of micro-batches waiting for their backward to pinned host "
                            "memory, back one micro-batch ahead (CUDA; a no-op on the CPU)")
    group.add_argument("--stages-per-rank", type=int, default=None, help="virtual stages per rank (interleaved schedules)")
    group.add_argument("--balance", type=_balance, default=None, help="blocks per stage, e.g. 3,5")
    group.add_argument("--partition", default=None,
                       help=f"split without --balance: {' | '.join(PARTITION_METHODS)} (default: uniform; time "
                            "with --mem-cap; priced for a mixture-of-experts --model DIR); time and memory use "
                            "measured per-block costs, priced the FLOPs the planner prices from the folder's config")
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
    group.add_argument("--deferred-batchnorm", action="store_true",
                       help="update BatchNorm running statistics once per step from the whole batch, not once per "
                            "micro-batch (torchgpipe's deferred batch norm)")


def default_partition(args: argparse.Namespace) -> str:
    """`--partition` when not given: `priced` for a mixture-of-experts `--model DIR` split over stages (its dense first
    layers, embedding and head weigh unlike its MoE layers), else `uniform`."""
    folder = getattr(args, "model", None)
    if folder is None or args.pp * (args.stages_per_rank or 1) < 2 or getattr(args, "balance", None) is not None:
        return "uniform"
    try:
        sizes = load_sizes(folder)
    except ConfigError:  # not a folder the planner prices: the engine's count split
        return "uniform"
    return "priced" if any(sizes.is_moe(i) for i in range(sizes.layers)) else "uniform"


def parallel_config(args: argparse.Namespace) -> ParallelConfig:
    """The validated mesh configuration of parsed arguments."""
    checkpoint, unit = recomputation(args.checkpoint, getattr(args, "recompute_unit", None))
    pipeline = PipelineConfig(
        pp=args.pp,
        schedule=args.schedule,
        n_microbatches=args.chunks,
        checkpoint=checkpoint,
        recompute_unit=unit,
        recompute_every=getattr(args, "recompute_every", 1),
        selective_matmuls=getattr(args, "selective_matmuls", "all"),
        offload_activations=getattr(args, "offload_activations", False),
        stages_per_rank=args.stages_per_rank,
        balance=args.balance,
        partition=args.partition or ("time" if args.mem_cap is not None else default_partition(args)),
        shape_cache=args.shape_cache,
        compile=getattr(args, "compile", False),
        deferred_batchnorm=getattr(args, "deferred_batchnorm", False),
        moe_overlap=getattr(args, "moe_overlap", "off") == "on",
    )
    return ParallelConfig(dp=args.dp, dp_mode=args.dp_mode, pipeline=pipeline, tp=getattr(args, "tp", 1),
                          sequence_parallel=getattr(args, "sequence_parallel", False),
                          loss_parallel=getattr(args, "loss_parallel", False),
                          fsdp_reshard=getattr(args, "fsdp_reshard", "never"), dp_shard=getattr(args, "dp_shard", None),
                          cp=getattr(args, "cp", 1), cp_attention=getattr(args, "cp_attention", "ring"),
                          ep=getattr(args, "ep", 1))


def cost_balanced(config: TrainConfig, args: argparse.Namespace, *, launched: bool, say: bool = True) -> TrainConfig:
    """`config` with the balance `--partition time|memory` (and `--mem-cap`) chooses from measured block costs: the
    costs of `--profile`, else measured on the job's device (see `pipetrain.train.layout.balanced`)."""
    from pipetrain.train.layout import balanced  # torch: not at import (bad flags are said before it)

    request = replace(config.layout, profile=args.profile, mem_cap=args.mem_cap)
    device = device_choice(args) if args.profile is None else "cpu"
    return balanced(replace(config, layout=request), device=device, launched=launched, say=say)

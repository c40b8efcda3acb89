"""`pipetrain profile`: measure each block's time and memory at several micro-batch sizes, fit a fixed plus a
per-sample cost per block, and write the profile JSON."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from pipetrain.cli.device_args import add_device_argument, device_choice
from pipetrain.errors import ConfigError
from pipetrain.partition.measure import default_sizes
from pipetrain.partition.profile import ModelProfile, save_profile
from pipetrain.train.profiling import measure_profile
from pipetrain.workloads.registry import get_workload, workload_names

__all__ = ["add_parser", "run", "profile_lines", "check_tp"]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("profile", help=__doc__, description=__doc__)
    parser.add_argument("--workload", default="classifier",
                        help=f"whose model: {' | '.join(workload_names())}, or MODULE:NAME or path/to/file.py:NAME "
                             "(default: classifier)")
    parser.add_argument("--preset", default="cpu", help="model size of the workload: tiny | cpu | ... (default: cpu)")
    parser.add_argument("--micro-batch-size", type=int, default=16,
                        help="samples per micro-batch = batch size / dp / chunks (default: 16)")
    parser.add_argument("--sizes", type=_sizes, default=None, metavar="N,N,...",
                        help="micro-batch sizes to measure and fit (fixed + per-sample cost per block); one size: "
                             "no fit, costs rescaled linearly (default: 1, 2, 4, ... up to --micro-batch-size)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per block; the median is kept (default: 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs per block first (default: 1)")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads while measuring (default: 1, as each training rank uses)")
    parser.add_argument("--output", "-o", type=Path, default=Path("profile.json"),
                        help="profile JSON to write (default: profile.json)")
    parser.add_argument("--tp", type=int, default=1, metavar="N",
                        help="refused above 1: a profile holds unsplit blocks on one device (the planner derives "
                             "tensor parallelism from the analytic model and `plan --calibrate`)")
    add_device_argument(parser)
    return parser


def check_tp(tp: int) -> None:
    """ConfigError for --tp above 1 (see docs/tensor-parallel.md, "Profiles and tp")."""
    if tp != 1:
        raise ConfigError(
            f"pipetrain profile --tp {tp}: a profile measures each unsplit block on one device, and no planner "
            "input comes from a tensor-parallel profile (`plan --profile` plans tp 1 only; the planner prices tp "
            "from the analytic model's split and the calibration's measured TP layer)",
            hint="profile with --tp 1; for tp plans use `pipetrain plan --calibrate` and `plan --tp N` without "
                 "--profile")


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"sizes must be comma-separated micro-batch sizes >= 1, got {text!r}")
    return sizes


def profile_lines(profile: ModelProfile) -> list[str]:
    """A readable table of `profile`, one line per block plus a total."""
    lines = [f"{'block':>5} {'name':<24} {'fwd ms':>8} {'bwd ms':>8} {'params MB':>10} {'act MB':>8} {'out MB':>8}"]
    for b in profile.blocks:
        lines.append(
            f"{b.index:>5} {b.name[:24]:<24} {b.forward_s * 1e3:>8.3f} {b.backward_s * 1e3:>8.3f} "
            f"{b.param_bytes / 2**20:>10.3f} {b.activation_bytes / 2**20:>8.3f} {b.output_bytes / 2**20:>8.3f}"
        )
    total_ms = sum(b.time_s for b in profile.blocks) * 1e3
    lines.append(f"total forward+backward {total_ms:.2f} ms per micro-batch of {profile.micro_batch_size} on {profile.device}")
    if profile.fitted:
        fixed_ms = sum(b.forward_fixed_s + b.backward_fixed_s for b in profile.blocks) * 1e3
        lines.append(f"fitted over micro-batch sizes {', '.join(map(str, profile.sizes))}: {fixed_ms:.2f} ms fixed "
                     f"per micro-batch + {(total_ms - fixed_ms) / profile.micro_batch_size:.3f} ms per sample")
    return lines


def run(args: argparse.Namespace) -> int:
    check_tp(args.tp)
    if args.threads < 1:
        raise ConfigError(f"--threads {args.threads} is too small", hint="pass --threads 1 or more")
    device = device_choice(args)
    if device == "cpu":
        torch.set_num_threads(args.threads)
    model = get_workload(args.workload).model(args.preset)
    if args.micro_batch_size < 1:
        raise ConfigError(f"--micro-batch-size {args.micro_batch_size} is too small", hint="pass 1 or more")
    sizes = args.sizes or default_sizes(args.micro_batch_size)
    if args.micro_batch_size not in sizes:
        sizes = (*sizes, args.micro_batch_size)
    profile = measure_profile(model, sizes, reference=args.micro_batch_size, device=device,
                              repeats=args.repeats, warmup=args.warmup, name=f"{args.workload}:{args.preset}")
    save_profile(profile, args.output)
    for line in profile_lines(profile):
        print(line)
    print(f"profile: {args.output}")
    return 0

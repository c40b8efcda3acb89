"""`--layout auto` for `train` (and, through it, `sbatch`): the planner chooses pp, dp, dp-mode, schedule, chunks,
recomputation and balance; the layout flags given beside it constrain the search.

Where the figures come from: block costs from `--profile FILE`, else measured here at several micro-batch sizes
(fixed + per-sample fit); the device and network from `--calibration FILE` (default: this machine's stored one),
else measured here first. Both are said, with how long they took. Ranks started by a launcher (torchrun, srun)
decide from the files alone, so every rank computes the same choice: there they need both files.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.errors import ConfigError
from pipetrain.launch.env import ClusterEnv, expand_for_local_ranks
from pipetrain.plan.auto import AutoChoice, Fixed, choose_layout, layout_flags
from pipetrain.plan.hardware import Calibration, default_calibration_path, load_calibration, save_calibration
from pipetrain.plan.predict import Layout

__all__ = ["add_layout_arguments", "resolve_layout", "explicit_layout", "mark_defaults", "is_default", "LAYOUT_DESTS"]

log = logging.getLogger("pipetrain")
_MB = 2**20
#: The flags --layout auto chooses (dest names); given on the command line (or in --config), they fix that choice.
LAYOUT_DESTS = ("pp", "dp", "dp_mode", "schedule", "chunks", "checkpoint", "stages_per_rank", "balance", "partition")


class _DefaultInt(int):
    """An int default argparse left in place: the flag was not given."""


class _DefaultStr(str):
    """A str default argparse left in place: the flag was not given."""


def mark_defaults(parser: argparse.ArgumentParser, dests: tuple[str, ...] = LAYOUT_DESTS) -> None:
    """Mark the int and str defaults of `dests` in `parser`, so that `is_default` tells a flag not given."""
    for action in parser._actions:
        if action.dest in dests and isinstance(action.default, (int, str)) and not is_default(action.default):
            action.default = (_DefaultStr if isinstance(action.default, str) else _DefaultInt)(action.default)


def is_default(value: object) -> bool:
    """Whether `value` is a default `mark_defaults` marked (the flag was not given)."""
    return isinstance(value, (_DefaultInt, _DefaultStr))


def _prediction(text: str) -> tuple[float, float]:
    try:
        step, mem = (float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected STEP_S,MEM_MB, got {text!r}") from None
    return step, mem


def add_layout_arguments(parser: argparse.ArgumentParser) -> None:
    """The group "automatic layout"; call after the parallelism flags are added (it marks their defaults, so that
    the flags a user gives can be told from the defaults)."""
    group = parser.add_argument_group("automatic layout")
    group.add_argument("--layout", choices=("manual", "auto"), default="manual",
                       help="auto: the planner chooses pp, dp, dp-mode, schedule, chunks, recomputation and balance "
                            "for the ranks, global batch and memory; layout flags given with it constrain the search "
                            "(default: manual, the flags as given)")
    group.add_argument("--nproc", type=int, default=None, metavar="N",
                       help="with --layout auto, ranks to spawn here (default: --dp x --pp when given, else the GPUs "
                            "of this node, or 2 on the CPU); a launcher's world size otherwise")
    group.add_argument("--calibration", type=Path, default=None, metavar="FILE",
                       help=f"with --layout auto: device and network figures (default: {default_calibration_path()}; "
                            "measured first, about 30 s, when missing)")
    group.add_argument("--layout-prediction", type=_prediction, default=None, metavar="STEP_S,MEM_MB",
                       help="a predicted step time and rank-0 memory to log the measured ones beside (set by "
                            "`pipetrain sbatch --layout auto`)")
    mark_defaults(parser)


def explicit_layout(args: argparse.Namespace) -> Fixed:
    """The layout choices given as flags (a value still the marked default is not given)."""
    def given(name: str):
        value = getattr(args, name, None)
        return None if value is None or is_default(value) else value

    if given("balance") is not None:
        raise ConfigError(f"--balance {','.join(map(str, args.balance))} fixes the split that --layout auto chooses",
                          hint="drop --balance, or constrain the split with --partition uniform|time")
    partition = given("partition")
    if partition not in (None, "uniform", "time"):
        raise ConfigError(f"--partition {partition} is not a split --layout auto predicts",
                          hint="use --partition uniform or time with --layout auto, or drop it")
    return Fixed(pp=given("pp"), dp=given("dp"), dp_mode=given("dp_mode"), schedule=given("schedule"),
                 chunks=given("chunks"), checkpoint=given("checkpoint"), virtual=given("stages_per_rank"),
                 balance=partition)


def _world(args: argparse.Namespace, env: ClusterEnv | None, fixed: Fixed, device: str) -> int:
    if env is not None:
        if args.nproc is not None:
            raise ConfigError("--nproc is for a job this command spawns, not ranks started by a launcher",
                              hint="drop --nproc: the launcher's world size is used")
        ranks = expand_for_local_ranks(env, args.ranks_per_node) if args.ranks_per_node else None
        return ranks[0].world_size if ranks else env.world_size
    if args.nproc is not None:
        if args.nproc < 1:
            raise ConfigError(f"--nproc must be 1 or more, got {args.nproc}", hint="pass --nproc 2, for example")
        return args.nproc
    if fixed.pp is not None or fixed.dp is not None:
        return (fixed.pp or 1) * (fixed.dp or 1)
    if device == "cuda":
        import torch

        return max(1, torch.cuda.device_count())
    return 2


def _calibration(args: argparse.Namespace, launched: bool, device: str, say: bool) -> tuple[Calibration, str]:
    path = args.calibration or default_calibration_path()
    if not path.exists():
        if launched:
            raise ConfigError(f"--layout auto on ranks started by a launcher needs a calibration file; {str(path)!r} "
                              "is missing (each rank measuring on its own could choose differently)",
                              hint="measure it first with `pipetrain plan --calibrate --gpus 2`, or pass --calibration")
        from pipetrain.bench.calibrate import calibrate
        from pipetrain.workloads.classifier.presets import PRESETS

        if say:
            log.info("pipetrain: --layout auto: no calibration at %s: measuring this machine first (2 ranks, "
                     "about 30 s)", path)
        c = PRESETS.get(args.preset, PRESETS["cpu"]) if args.workload == "classifier" else PRESETS["cpu"]
        start = time.perf_counter()
        measured = calibrate(dict(seq_len=c.seq_len, emsize=c.emsize, nhead=c.nhead, nhid=c.nhid, dropout=c.dropout),
                             device=device, precision="fp32-strict" if args.precision == "fp32-strict" else "fp32")
        save_calibration(measured, path)
        return measured, f"measured now in {time.perf_counter() - start:.0f} s, stored in {path}"
    return load_calibration(path), f"{path} ({load_calibration(path).measured.split(',')[0]})"


def _blocks(args: argparse.Namespace, model, launched: bool, device: str, batch: int, say: bool):
    from pipetrain.partition.measure import default_sizes, model_fingerprint, profile_model_sizes
    from pipetrain.partition.profile import load_profile
    from pipetrain.plan.model import profile_blocks

    if args.profile is not None:
        profile = load_profile(args.profile)
        if profile.fingerprint != model_fingerprint(model):
            raise ConfigError(f"the profile {str(args.profile)!r} is of another model ({profile.model!r})",
                              hint="profile this model with `pipetrain profile` (same workload and preset)")
        source = f"profile {args.profile} ({profile.describe()})"
    elif launched:
        raise ConfigError("--layout auto on ranks started by a launcher needs --profile FILE (each rank measuring "
                          "on its own could choose differently)",
                          hint="write one first with `pipetrain profile --output FILE` and pass --profile FILE")
    else:
        sizes = default_sizes(min(16, batch))
        if say:
            log.info("pipetrain: --layout auto: measuring each block at micro-batch sizes %s (pass --profile FILE "
                     "to reuse a profile)", ", ".join(map(str, sizes)))
        start = time.perf_counter()
        profile = profile_model_sizes(model, sizes, device=device, repeats=3)
        source = f"measured now in {time.perf_counter() - start:.1f} s ({profile.describe()})"
    return profile_blocks(profile), source


def _accepts(num_blocks: int) -> Callable[[Layout], bool]:
    def accepts(layout: Layout) -> bool:
        try:
            pipeline = PipelineConfig(pp=layout.pp, schedule=layout.schedule, n_microbatches=layout.chunks,
                                      checkpoint=layout.checkpoint,
                                      stages_per_rank=layout.virtual if layout.virtual > 1 else None)
            pipeline.check_blocks(num_blocks)
            ParallelConfig(dp=layout.dp, dp_mode=layout.dp_mode, pipeline=pipeline)
        except ConfigError:
            return False
        return True
    return accepts


def _placeholder(args: argparse.Namespace) -> argparse.Namespace:
    """A copy of `args` with a one-rank layout, to build the job's model before its layout is chosen."""
    return argparse.Namespace(**{**vars(args), "pp": 1, "dp": 1, "dp_mode": "ddp", "schedule": "gpipe", "chunks": 1,
                                 "checkpoint": "never", "stages_per_rank": None, "balance": None, "partition": None,
                                 "mem_cap": None, "profile": None})


def resolve_layout(args: argparse.Namespace, env: ClusterEnv | None, *,
                   model: Callable[[argparse.Namespace], object],
                   device: str, ranks_per_node: int | None = None) -> AutoChoice | None:
    """With `--layout auto`: choose the layout and write its flags into `args` (logged on rank 0, with the
    prediction, which `args.layout_prediction` then carries to the run log). None without it. `ranks_per_node`:
    the job's ranks per node when it is not this one (`sbatch`); default: all here, or the launcher's. `model`:
    the job's model of parsed arguments (given a copy with a placeholder layout)."""
    if args.layout != "auto":
        return None
    say = env is None or env.rank == 0
    fixed = explicit_layout(args)
    world = _world(args, env, fixed, device)
    built = model(_placeholder(args))
    calib, calib_source = _calibration(args, env is not None, device, say)
    blocks, blocks_source = _blocks(args, built, env is not None, device, args.batch_size, say)
    node = ranks_per_node or (world if env is None else env.local_world_size * (args.ranks_per_node or 1))
    memory = args.mem_cap * _MB if args.mem_cap is not None else (
        calib.device.memory_bytes / max(1, node) if calib.device.cores else calib.device.memory_bytes)
    dev = replace(calib.device, memory_bytes=memory)
    choice = choose_layout(blocks, world=world, batch=args.batch_size, device=dev, network=calib.network, fixed=fixed,
                           gpus_per_node=node if node < world else 0, accepts=_accepts(len(blocks)))
    best = choice.prediction
    lay = best.layout
    args.pp, args.dp, args.dp_mode, args.schedule = lay.pp, lay.dp, lay.dp_mode, lay.schedule
    args.chunks, args.checkpoint = lay.chunks, lay.checkpoint
    args.stages_per_rank = lay.virtual if lay.virtual > 1 else None
    args.balance = best.balance if lay.pp * lay.virtual > 1 else None
    args.partition, args.profile, args.mem_cap = None, None, None  # the split is chosen: nothing left to balance
    args.layout_prediction = (best.step_s, best.memory_bytes[0] / _MB)
    args.layout = "manual"  # the run's recorded configuration (config.toml) is the explicit layout it ran
    if say:
        log.info("pipetrain: --layout auto chose %s for %d ranks, global batch %d (%d layouts predicted)",
                 " ".join(layout_flags(best)), world, args.batch_size, choice.considered)
        log.info("pipetrain: predicted %.3f s/step, memory per rank %s MB (budget %.0f MB); block costs: %s; "
                 "device and network: %s", best.step_s, "/".join(f"{m / _MB:.0f}" for m in best.memory_bytes),
                 memory / _MB, blocks_source, calib_source)
    return choice

"""`pipetrain plan`: choose dp, pp, tp, schedule, chunks, recomputation and balance before a job is submitted."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from pipetrain.cli.device_args import device_choice
from pipetrain.cli.plan_args import DEFAULT_MODEL_SEQ_LEN, add_plan_arguments
from pipetrain.cli.plan_calibration import calibration
from pipetrain.cli.plan_space import context_space, engine_has, expert_space, shard_space, tensor_space
from pipetrain.errors import ConfigError
from pipetrain.launch.env import detect
from pipetrain.plan.auto import memory_flags
from pipetrain.plan.describe import describe
from pipetrain.plan.loss import with_loss
from pipetrain.plan.model import BlockCost, config_blocks, profile_blocks
from pipetrain.plan.predict import Prediction
from pipetrain.plan.search import SearchResult, SearchSpace, search
from pipetrain.plan.transformer import read_config, sizes_from_config
from pipetrain.workloads.classifier.presets import PRESETS

__all__ = ["add_parser", "run", "add_plan_arguments", "planned", "train_args", "measure_across_nodes"]

log = logging.getLogger("pipetrain")
_GB = 2**30
#: Devices per node when only --gpus is given (pipeline neighbours inside a node, dp across nodes beyond it).
ASSUMED_GPUS_PER_NODE = 8


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("plan", help=__doc__, description=__doc__)
    add_plan_arguments(parser)
    return parser


def _positive(name: str, value: int | float | None) -> None:
    if value is not None and not value > 0:
        raise ConfigError(f"--{name} must be positive, got {value}", hint=f"pass --{name} 1 or more")


def _devices(args: argparse.Namespace) -> tuple[int, int]:
    for name in ("gpus", "nodes", "gpus_per_node", "batch", "top", "max_chunks", "max_pp", "pp", "gpu_mem", "tp",
                 "seq_len", "chunks", "stages_per_rank"):
        _positive(name.replace("_", "-"), getattr(args, name))
    if args.gpus is not None and args.nodes is not None:
        raise ConfigError("both --gpus and --nodes given", hint="pass --gpus N, or --nodes N --gpus-per-node G")
    if args.nodes is not None:
        if args.gpus_per_node is None:
            raise ConfigError("--nodes needs --gpus-per-node", hint="e.g. --nodes 2 --gpus-per-node 8")
        return args.nodes * args.gpus_per_node, args.gpus_per_node
    if args.gpus is None:
        raise ConfigError("how many devices?", hint="pass --gpus N, or --nodes N --gpus-per-node G")
    return args.gpus, args.gpus_per_node or min(args.gpus, ASSUMED_GPUS_PER_NODE)


def model_blocks(args: argparse.Namespace) -> tuple[list[BlockCost], str]:
    """The block costs and a description of where they come from."""
    model = getattr(args, "model", None)
    if model is None and (getattr(args, "seq_len", None) is not None or getattr(args, "loss_parallel", False)
                          or getattr(args, "bf16_logits", False)):
        raise ConfigError("--seq-len, --loss-parallel and --bf16-logits price a --model",
                          hint="pass --model DIR|config.json")
    if model is not None:
        given = [flag for flag, value in (("--preset", args.preset), ("--profile", args.profile)) if value is not None]
        if given:
            raise ConfigError(f"both --model and {given[0]} given", hint="pass one of them")
        config, file = read_config(model)
        sizes = sizes_from_config(config, str(file))
        longest = config.get("max_position_embeddings") or config.get("n_positions") or DEFAULT_MODEL_SEQ_LEN
        seq_len = args.seq_len or min(DEFAULT_MODEL_SEQ_LEN, longest)
        if seq_len > longest:
            raise ConfigError(f"--seq-len {seq_len} is longer than the model's {longest} positions",
                              hint=f"pass --seq-len {longest} or less")
        element = 2 if args.precision == "bf16" else 4
        if getattr(args, "bf16_logits", False) and element != 2:
            raise ConfigError("--bf16-logits needs bf16 activations", hint="add --precision bf16")
        args.model_sizes, args.model_seq_len = sizes, seq_len
        blocks = sizes.blocks(seq_len, element=element, vocab_parallel=getattr(args, "loss_parallel", False),
                              logits_element=2 if getattr(args, "bf16_logits", False) else 4)
        return blocks, f"{file} priced from its config at seq len {seq_len} ({sizes.summary()})"
    if args.profile is not None:
        if args.preset is not None:
            raise ConfigError("both --preset and --profile given", hint="pass one of them")
        from pipetrain.partition.profile import load_profile

        profile = load_profile(args.profile)
        args.profile_model = profile.model
        return (with_loss(profile_blocks(profile), _profile_loss(profile.model)),
                f"profile {args.profile} ({profile.model}, {profile.describe()})")
    preset = args.preset or "cpu"
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}", hint=f"choose one of: {', '.join(PRESETS)}, or pass --profile")
    return config_blocks(PRESETS[preset]), f"analytic reference Transformer, preset {preset!r}"


def _profile_loss(model: str) -> object:
    """The loss of the workload a profile names ("workload:preset"), or None (a model of no known workload)."""
    from pipetrain.workloads.registry import get_workload

    workload = model.rpartition(":")[0]
    try:
        return get_workload(workload).loss() if workload else None
    except (ConfigError, ImportError, OSError, ValueError):  # not a workload here: its loss is not counted
        return None


def planned(args: argparse.Namespace, **fixed) -> tuple[SearchResult, dict]:
    """Run the search for parsed `plan`/`tune` arguments (`fixed`: SearchSpace fields forced by the caller)."""
    gpus, per_node = _devices(args)
    blocks, source = model_blocks(args)
    calib, calib_source = calibration(args)
    device = calib.device
    if args.gpu_mem is not None:
        from dataclasses import replace

        device = replace(device, memory_bytes=args.gpu_mem * _GB)
    float8 = getattr(args, "float8", False)
    if float8 and args.precision != "bf16":
        raise ConfigError("--float8 trains Float8 projections in a bf16 job", hint="add --precision bf16")
    chosen = dict(schedules=tuple(args.schedules), checkpoints=tuple(args.checkpoints), dp_modes=tuple(args.dp_modes),
                  max_chunks=args.max_chunks, max_pp=args.max_pp, only_pp=args.pp,
                  only_chunks=getattr(args, "chunks", None), precision="bf16" if args.precision == "bf16" else "fp32",
                  float8=float8, recompute_unit=getattr(args, "recompute_unit", "stage"),
                  keep_outputs=getattr(args, "keep_outputs", False),
                  recompute_every=getattr(args, "recompute_every", 1),
                  selective_matmuls={"both": ("all", "alternate")}.get(
                      getattr(args, "selective_matmuls", "both"), (getattr(args, "selective_matmuls", "both"),)),
                  fsdp_reshard=getattr(args, "fsdp_reshard", "never"),
                  offload={"off": (False,), "on": (True,), "both": (False, True)}[
                      getattr(args, "offload_activations", "off")])
    if getattr(args, "stages_per_rank", None):
        chosen["virtual"] = (args.stages_per_rank,)
    if "tps" not in fixed:
        chosen.update(tensor_space(args, blocks, gpus, per_node))
    chosen.update(expert_space(args, blocks, gpus))
    chosen.update(context_space(args, blocks))
    chosen.update(shard_space(args))
    space = SearchSpace(**{**chosen, **fixed})
    start = time.perf_counter()
    result = search(blocks, gpus=gpus, batch=args.batch, device=device, network=calib.network, space=space,
                    gpus_per_node=per_node, top=args.top)
    info = {"gpus": gpus, "gpus_per_node": per_node, "model": source, "calibration": calib_source,
            "memory_gb": device.memory_bytes / _GB, "seconds": time.perf_counter() - start, "space": space,
            "blocks": len(blocks)}
    return result, info


def train_args(prediction: Prediction, args: argparse.Namespace) -> list[str]:
    """`pipetrain train` flags for a predicted layout (layout flags included)."""
    lay = prediction.layout
    out = ["--pp", str(lay.pp), "--dp", str(lay.dp)] + (["--tp", str(lay.tp)] if lay.tp > 1 else []) \
        + (["--ep", str(lay.ep)] if lay.ep > 1 and engine_has("ep") else []) \
        + (["--moe-overlap", "on"] if lay.moe_overlap and engine_has("moe_overlap") else []) \
        + (["--cp", str(lay.cp), "--cp-attention", lay.cp_attention] if lay.cp > 1 and engine_has("cp") else [])
    out += ["--dp-mode", lay.dp_mode, "--schedule", lay.schedule, "--chunks", str(lay.chunks),
            "--checkpoint", lay.checkpoint, "--batch-size", str(lay.batch)] + memory_flags(lay)
    if lay.sequence_parallel:
        out.append("--sequence-parallel")
    if lay.tp > 1 and getattr(args, "loss_parallel", False):  # priced with the vocabulary-parallel head
        out.append("--loss-parallel")
    if lay.virtual > 1:
        out += ["--stages-per-rank", str(lay.virtual)]
    if lay.balance == "time" and len(prediction.balance) > 1:
        out += ["--balance", ",".join(str(b) for b in prediction.balance)]
    precision = getattr(args, "precision", "fp32")  # a Namespace made by hand may lack it
    if precision != "fp32":
        out += ["--precision", precision]
    if getattr(args, "model", None) is not None:
        folder = Path(args.model)
        folder = folder if folder.is_dir() else folder.parent
        return out + ["--workload", "hf", "--model", str(folder), "--seq-len", str(args.model_seq_len)]
    if args.profile:  # the profile names its model "workload:preset"
        workload, _, preset = getattr(args, "profile_model", "").rpartition(":")
        return out + (["--workload", workload] if workload else []) + ["--preset", preset or "cpu"]
    return out + ["--preset", args.preset or "cpu"]


def _row(rank: int, p: Prediction) -> str:
    lay = p.layout
    schedule = lay.schedule + (f"x{lay.virtual}" if lay.virtual > 1 else "") + ("+ov" if lay.moe_overlap else "")
    memory = "/".join(f"{m / _GB:.2f}" for m in p.memory_bytes) if len(p.memory_bytes) <= 4 else \
        f"max {max(p.memory_bytes) / _GB:.2f}"
    tp = (f"{lay.tp}{'sp' if lay.sequence_parallel else ''}{f'/ep{lay.ep}' if lay.ep > 1 else ''}"
          f"{f'/cp{lay.cp}' if lay.cp > 1 else ''}")
    checkpoint = lay.checkpoint if lay.recompute_unit == "stage" or lay.checkpoint == "never" else (
        ("selective" if lay.selective_matmuls == "all" else "sel-alt")
        if lay.recompute_unit == "selective" and lay.checkpoint == "always" else
        f"{lay.checkpoint}/{lay.recompute_unit}") + (f"/{lay.recompute_every}" if lay.recompute_every > 1 else "")
    mode = (lay.dp_mode + ("+rs" if lay.fsdp_reshard else "")) if lay.dp > 1 else "-"
    checkpoint += "+off" if lay.offload else ""
    return (f"{rank:>3} {lay.dp:>5} {lay.pp:>3} {tp:>4} {schedule:<18} {lay.chunks:>6} {checkpoint:<11} "
            f"{mode:<7} {lay.balance:<7} {p.step_s:>10.4f} {p.samples_per_s:>10.1f} "
            f"{100 * p.bubble:>6.1f}% {memory}")


def _per_schedule(result: SearchResult, flops_per_token: float, seq_len: int, gpus: int) -> None:
    """The fastest predicted layout of each schedule (fitting or not), in tokens and model FLOP/s per GPU."""
    fastest: dict[str, Prediction] = {}
    for p in sorted(result.best + result.too_big, key=lambda p: p.step_s):
        fastest.setdefault(p.layout.schedule, p)
    print("\nper schedule (fastest simulated layout of each; tokens/s per GPU, model TFLOP/s per GPU):")
    for schedule, p in fastest.items():
        tokens = p.samples_per_s * seq_len / gpus
        fits = "" if p in result.best else "  (too big)"
        print(f"  {schedule:<18} step {p.step_s:9.3f} s  {tokens:10.1f} tokens/s/GPU  "
              f"{tokens * flops_per_token / 1e12:7.1f} TFLOP/s  max {max(p.memory_bytes) / _GB:.1f} GiB  "
              f"bubble {100 * p.bubble:.1f} %{fits}")


def measure_across_nodes(args: argparse.Namespace) -> bool:
    """With --calibrate in a job that spans nodes (torchrun or Slurm variables): every rank measures the link
    between the nodes (`bench.internode`); rank 0 keeps the figures in `args.inter_node` for `calibration` and
    goes on (True), the other ranks are done (False). Outside such a job: True, nothing measured."""
    env = detect() if args.calibrate else None
    if env is None or env.num_nodes < 2:
        return True
    from pipetrain.bench.internode import measure_inter_node

    log.info("measuring the link across %d nodes (rank %d of %d)...", env.num_nodes, env.rank, env.world_size)
    args.inter_node = measure_inter_node(env, device=device_choice(args))
    if env.rank != 0:
        print(f"pipetrain plan: rank {env.rank} measured the link across the nodes; rank 0 calibrates its node "
              "and stores the calibration")
        return False
    return True


def run(args: argparse.Namespace) -> int:
    if not measure_across_nodes(args):
        return 0
    result, info = planned(args)
    assumed = "" if args.gpus_per_node else f" (up to {ASSUMED_GPUS_PER_NODE} per node assumed: pass --gpus-per-node)"
    print(f"pipetrain plan: {info['gpus']} devices{assumed}, {info['memory_gb']:.1f} GB each, global batch {args.batch}")
    print(f"  model: {info['model']}\n  device/network: {info['calibration']}")
    print(f"  {result.enumerated} layouts, {result.simulated} simulated, {info['seconds']:.3f} s")
    sizes = getattr(args, "model_sizes", None)
    if sizes is not None:
        for line in describe(sizes, args.model_seq_len, element=2 if args.precision == "bf16" else 4,
                             tp=result.best[0].layout.tp, ep=result.best[0].layout.ep,
                             cp=result.best[0].layout.cp):
            print(f"  {line}")
    what_if = [flag for flag, on in (("--float8", getattr(args, "float8", False)),
                                     ("--bf16-logits", getattr(args, "bf16_logits", False)),
                                     ("--keep-outputs", getattr(args, "keep_outputs", False))) if on]
    if what_if:
        print(f"  what-if: {', '.join(what_if)}: pipetrain's train does not run these; its line below is the nearest "
              "layout it runs")
    if result.best[0].layout.cp > 1 and not engine_has("cp"):
        print(f"  context parallelism planned (cp={result.best[0].layout.cp}), but this pipetrain's train has no "
              "--cp: its line below keeps each sequence whole on a rank")
    if result.best[0].layout.ep > 1 and not engine_has("ep"):
        print(f"  expert parallelism planned (ep={result.best[0].layout.ep}), but this pipetrain's train has no --ep: "
              "its line below holds every expert on every rank of a stage")
    if info["space"].tps == (1,) and getattr(args, "tp", None) is None:
        print("  tensor parallelism not considered: this pipetrain's train has no --tp (pass --tp N to plan it)")
    print(f"\n{'#':>3} {'dp':>5} {'pp':>3} {'tp':>4} {'schedule':<18} {'chunks':>6} {'checkpoint':<11} {'mode':<7} "
          f"{'balance':<7} {'step s':>10} {'samples/s':>10} {'bubble':>7} memory GB per stage")
    for rank, prediction in enumerate(result.best, 1):
        print(_row(rank, prediction))
    if result.too_big:
        print(f"\nfaster but too big for {info['memory_gb']:.1f} GB ({len(result.too_big)} simulated):")
        for p in result.too_big[:3]:
            worst = max(range(len(p.memory_bytes)), key=lambda i: p.memory_bytes[i])
            print(_row(0, p).replace("  0", "  -", 1) +
                  f"  <- stage {worst} needs {p.memory_bytes[worst] / _GB:.2f} GB")
    if sizes is not None:
        _per_schedule(result, sizes.flops_per_token(args.model_seq_len), args.model_seq_len, info["gpus"])
    best = result.best[0]
    flags = train_args(best, args)
    python = sys.executable
    print("\nbest layout:\n  pipetrain train " + " ".join(flags))
    layout_flags = {"--pp", "--dp", "--tp", "--schedule", "--chunks"}
    rest = [f for i, f in enumerate(flags) if f not in layout_flags and (i == 0 or flags[i - 1] not in layout_flags)]
    per_node = info["gpus_per_node"]
    nodes = -(-info["gpus"] // per_node)
    tp = f"--tp {best.layout.tp} " if best.layout.tp > 1 else ""
    print(f"  pipetrain sbatch --nodes {nodes} --gpus-per-node {per_node} --dp {best.layout.dp} --pp {best.layout.pp} "
          f"{tp}--schedule {best.layout.schedule} --chunks {best.layout.chunks} --python {python} -- " + " ".join(rest))
    return 0

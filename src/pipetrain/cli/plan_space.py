"""The planner's search space from `plan`/`tune` arguments: the tensor-, expert- and context-parallel degrees to
try (and DualPipeV's all-to-all overlap), each given degree checked against the model with one message naming the
problem."""

from __future__ import annotations

import argparse
import dataclasses

from pipetrain.config import ParallelConfig
from pipetrain.errors import ConfigError
from pipetrain.plan.context import cp_problem
from pipetrain.plan.experts import ep_problem, expert_degrees, moe_blocks
from pipetrain.plan.model import BlockCost
from pipetrain.plan.overlap import OVERLAP_SCHEDULES
from pipetrain.plan.tensor import tp_problem

__all__ = ["engine_has", "tensor_space", "expert_space", "context_space", "shard_space"]


def engine_has(axis: str) -> bool:
    """Whether this pipetrain's `ParallelConfig` takes `axis` ("tp", "sequence_parallel"): the train line may
    carry the flag (the planner itself models tensor parallelism either way)."""
    def names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()

    nested = [f.default for f in dataclasses.fields(ParallelConfig) if dataclasses.is_dataclass(f.default)]
    return axis in names(ParallelConfig) or any(axis in names(type(value)) for value in nested)


def tensor_space(args: argparse.Namespace, blocks: list[BlockCost], gpus: int, per_node: int) -> dict:
    """The SearchSpace fields for tensor parallelism: `--tp N` checked (one message naming the problem), or
    every degree that divides a node when the engine has tp."""
    sp = getattr(args, "sequence_parallel", "off")
    with_sp = {"on": (True,), "off": (False,), "both": (False, True)}[sp]
    tp = getattr(args, "tp", None)
    if tp is None:
        tps = tuple(t for t in range(1, per_node + 1) if per_node % t == 0) if engine_has("tp") else (1,)
        return {"tps": tps, "sequence_parallel": with_sp}
    if per_node % tp:
        raise ConfigError(f"--tp {tp} would put a tensor-parallel group across nodes of {per_node} GPUs",
                          hint=f"pass a --tp that divides --gpus-per-node {per_node}")
    if gpus % tp:
        raise ConfigError(f"--tp {tp} does not divide the {gpus} GPUs", hint="pass a --tp that divides --gpus")
    problem = tp_problem(blocks, tp, sequence_parallel=with_sp == (True,))
    if problem:
        hint = ("a profile file has no TP plan: plan tensor parallelism with --preset" if "plan" in problem
                else "pass a --tp that divides it")
        raise ConfigError(f"--tp {tp}: {problem}", hint=hint)
    return {"tps": (tp,), "sequence_parallel": with_sp}


def expert_space(args: argparse.Namespace, blocks: list[BlockCost], gpus: int) -> dict:
    """The search's expert-parallel degrees: `--ep N`, else every power of 2 dividing the experts (a MoE model)."""
    ep, imbalance = getattr(args, "ep", None), getattr(args, "moe_imbalance", 1.0)
    moe = moe_blocks(blocks)
    if not imbalance >= 1.0:
        raise ConfigError(f"--moe-imbalance {imbalance} is below 1: the busiest expert has at least the mean load",
                          hint="pass 1.0 (balanced) or more")
    if ep is not None:
        problem = ep_problem(blocks, ep)
        if problem:
            raise ConfigError(f"--ep {ep}: {problem}", hint="pass --ep 1 for a dense model, or an ep that divides "
                                                            "the experts" if moe else "drop --ep: the model is dense")
        cp, pp, tp = getattr(args, "cp", 1), getattr(args, "pp", None) or 1, getattr(args, "tp", None) or 1
        if ep > 1 and cp > 1 and (pp > 1 or tp > 1):  # as train's ParallelConfig
            raise ConfigError(f"--ep {ep} with --cp {cp} and --pp {pp} --tp {tp}: expert parallelism beside context "
                              "parallelism is built at pp 1 and tp 1 only", hint="pass --pp 1 --tp 1 (or --cp 1)")
        return {"eps": (ep,), "moe_imbalance": imbalance, **_overlap(args, moe, ep > 1)}
    if not moe:
        return _overlap(args, moe, False)
    degrees = expert_degrees(blocks, gpus)
    return {"eps": degrees, "moe_imbalance": imbalance, **_overlap(args, moe, max(degrees) > 1)}


def _overlap(args: argparse.Namespace, moe: list[BlockCost], split: bool) -> dict:
    """`--moe-overlap on|off|both` (default: both where the experts may be split and dualpipev is searched)."""
    given = getattr(args, "moe_overlap", None)
    dualpipev = any(s in OVERLAP_SCHEDULES for s in getattr(args, "schedules", OVERLAP_SCHEDULES))
    if given == "on" and not (moe and split and dualpipev):
        why = ("the model has no experts" if not moe else "ep is 1" if not split
               else "no schedule searched fuses a forward with a backward")
        raise ConfigError(f"--moe-overlap on overlaps DualPipeV's all-to-alls, and {why}",
                          hint="search --schedules dualpipev with --ep 2 or more, or pass --moe-overlap off")
    choice = given or ("both" if moe and split and dualpipev else "off")
    return {"moe_overlap": {"on": (True,), "off": (False,), "both": (False, True)}[choice]}


def context_space(args: argparse.Namespace, blocks: list[BlockCost]) -> dict:
    """The search's context-parallel degree (`--cp N`, checked against the model) and attention."""
    cp, attention = getattr(args, "cp", 1), getattr(args, "cp_attention", "ring")
    problem = cp_problem(blocks, cp, attention)
    if problem:
        raise ConfigError(f"--cp {cp}: {problem}", hint="pass a --cp that splits the sequence (a --seq-len divisible "
                                                        "by 2 x cp for ring attention), or --cp 1")
    tp = getattr(args, "tp", None)
    sp_problem = tp_problem(blocks, tp, True, cp) if tp and cp > 1 and getattr(args, "sequence_parallel",
                                                                                 "both") == "on" else None
    if sp_problem:
        raise ConfigError(f"--cp {cp} with --sequence-parallel on: {sp_problem}",
                          hint="pass a --seq-len divisible by 2 x cp x tp, or --sequence-parallel off")
    return {"cps": (cp,), "cp_attention": attention}


def shard_space(args: argparse.Namespace) -> dict:
    """HSDP's shard group fixed by `--dp-shard K` (data replicas; with cp, K replicas and their cp ranks)."""
    shard = getattr(args, "dp_shard", None)
    if shard is None:
        return {}
    if shard < 1 or "hsdp" not in getattr(args, "dp_modes", ()):
        raise ConfigError(f"--dp-shard {shard}: shard groups are hsdp's, of K >= 1 data replicas",
                          hint="pass --dp-mode hsdp with --dp-shard K >= 1, or drop --dp-shard")
    return {"dp_shard": shard}

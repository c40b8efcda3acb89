"""The layout search: enumerate every layout of a GPU count (plan/space.py), drop those that do not fit, rank the rest.

Exact and fast by branch and bound: each candidate gets a cheap lower bound on its step time (plan/bound.py: the
busiest rank's compute, its gradient reduction and its optimizer step: a rank runs its actions one at a time, so
the simulated span is never shorter); candidates are simulated in order of that bound, and the search
stops when the next bound is slower than the `top`-th best fitting layout found. Every layout that was
simulated and does not fit is reported with its memory per stage.

Where a tensor-parallel degree may run with or without sequence parallelism, only the former is searched: it moves
the same collective volume in the same time and holds less (activations, receive buffers) and moves less (memory
traffic, stage-to-stage bytes), so it is never slower nor larger in this model. The enumeration (`SearchSpace`,
`enumerate_layouts`, `tp_options`) and the bound (`lower_bound_s`) are importable from here as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from pipetrain.config import SPLIT_BACKWARD_SCHEDULES
from pipetrain.errors import ConfigError
from pipetrain.plan.bound import lower_bound_s
from pipetrain.plan.context import cp_problem
from pipetrain.plan.experts import ep_cp_problem, ep_problem
from pipetrain.plan.hardware import Device, Network
from pipetrain.plan.model import BlockCost
from pipetrain.plan.predict import Prediction, predict
from pipetrain.plan.reshard import reshard_after_forward
from pipetrain.plan.space import SearchSpace, enumerate_layouts, tp_options
from pipetrain.plan.tensor import tp_problem

__all__ = ["SearchSpace", "SearchResult", "enumerate_layouts", "search", "lower_bound_s", "tp_options"]


@dataclass
class SearchResult:
    """The best fitting predictions (fastest first), the fastest ones that did not fit, and the counts."""

    best: list[Prediction]
    too_big: list[Prediction] = field(default_factory=list)
    enumerated: int = 0
    simulated: int = 0


def search(blocks: Sequence[BlockCost], *, gpus: int, batch: int, device: Device, network: Network,
           space: SearchSpace = SearchSpace(), gpus_per_node: int = 0, top: int = 10) -> SearchResult:
    """The `top` fastest layouts of `gpus` ranks that fit `device.memory_bytes` (ConfigError when none)."""
    tps = [(tp, sp) for tp, sp in tp_options(gpus, space, gpus_per_node) if tp_problem(blocks, tp, sp) is None]
    # sequence parallelism dominates (see above); beside cp > 1 both are kept (tp must also divide a cp rank's part)
    tps = [(tp, sp) for tp, sp in tps if sp or (tp, True) not in tps or max(space.cps) > 1]
    layouts = [layout for layout in enumerate_layouts(len(blocks), gpus, batch, space, gpus_per_node, tps)
               if ep_problem(blocks, layout.ep) is None and ep_cp_problem(layout) is None
               and cp_problem(blocks, layout.cp, layout.cp_attention) is None
               and tp_problem(blocks, layout.tp, layout.sequence_parallel, layout.cp) is None]
    if not layouts:
        raise ConfigError(_no_layout(len(blocks), gpus, batch), hint=_gpu_hint(len(blocks), gpus, batch))
    cache: dict = {}
    bounded = sorted(((lower_bound_s(blocks, layout, device, network, cache), i) for i, layout in enumerate(layouts)))
    result = SearchResult(best=[], enumerated=len(layouts))
    seen_balance: set[tuple] = set()
    for bound, index in bounded:
        if len(result.best) >= top and bound > result.best[-1].step_s:
            break
        layout = layouts[index]
        prediction = predict(blocks, layout, device, network)
        result.simulated += 1
        if _reshards_to_fit(layout, prediction, space, device):  # "auto" inside a pipeline: only where it must
            prediction = predict(blocks, replace(layout, fsdp_reshard=True), device, network)
            result.simulated += 1
        key = (replace(layout, balance="uniform"), prediction.balance)
        if key in seen_balance:
            continue  # "time" gave the uniform split: the same layout twice
        seen_balance.add(key)
        if max(prediction.memory_bytes) > device.memory_bytes:
            result.too_big.append(prediction)
            continue
        result.best.append(prediction)
        result.best.sort(key=lambda p: p.step_s)
        del result.best[top:]
    if not result.best:
        smallest = min(max(predict(blocks, layout, device, network).memory_bytes) for layout in layouts)
        raise ConfigError(
            f"no layout of {gpus} GPUs fits in {device.memory_bytes / 2**30:.1f} GB per GPU "
            f"(the leanest needs {smallest / 2**30:.2f} GB per GPU)",
            hint=f"pass --gpu-mem {smallest / 2**30:.2f} or more, more GPUs, or a smaller --batch",
        )
    result.too_big.sort(key=lambda p: p.step_s)
    return result


def _reshards_to_fit(layout: Layout, prediction: Prediction, space: SearchSpace, device: Device) -> bool:
    """Whether `--fsdp-reshard auto` reshards this FSDP layout in a pipeline: its gathered weights do not fit."""
    if space.fsdp_reshard != "auto" or layout.fsdp_reshard or layout.shards == 1 or layout.dp == 1:
        return False
    if layout.schedule in SPLIT_BACKWARD_SCHEDULES:
        return False
    over = max(prediction.memory_bytes) - device.memory_bytes
    return reshard_after_forward("auto", pp=layout.pp, gathered_bytes=over, budget_bytes=0.0) is True


def _no_layout(num_blocks: int, gpus: int, batch: int) -> str:
    return (f"no layout of {gpus} GPUs: dp x pp must equal {gpus} with pp <= {num_blocks} (the model's blocks) "
            f"and dp dividing the global batch {batch}")


def _gpu_hint(num_blocks: int, gpus: int, batch: int) -> str:
    def works(n: int) -> bool:
        return any(n % pp == 0 and batch % (n // pp) == 0 for pp in range(1, min(num_blocks, n) + 1))

    below = next((n for n in range(gpus - 1, 0, -1) if works(n)), None)
    above = next((n for n in range(gpus + 1, 2 * gpus + 2) if works(n)), None)
    options = " or ".join(str(n) for n in (below, above) if n)
    return f"use {options} GPUs, or a batch divisible by more GPU counts"

"""The tensor-parallel plan of the GPT-style decoder (`GPTModel.tp_plan`): Megatron's split of each layer.

Each decoder layer: the fused (q, k, v) projection column-parallel by heads (`FusedColwiseParallel(3)`), the
attention output projection row-parallel, the MLP's first linear column-parallel and its second row-parallel:
two all-reduces forward and two backward per layer. The embedding and the head are kept whole on every TP rank.
"""

from __future__ import annotations

from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from pipetrain.errors import ConfigError
from pipetrain.parallel.tensor import TPPlan
from pipetrain.parallel.tensor_styles import FusedColwiseParallel
from pipetrain.workloads.gpt import GPTConfig

__all__ = ["gpt_tp_plan"]


def check_divides(tp: int, what: str, size: int, flag: str) -> None:
    """Raise unless `tp` divides `size` (the `what` of the model: heads, hidden size, vocabulary)."""
    if size % tp:
        divisors = [d for d in range(1, size + 1) if size % d == 0][:8]
        raise ConfigError(f"tp={tp} does not divide the {size} {what} of the model",
                          hint=f"pass {flag} among the divisors of {size} ({', '.join(map(str, divisors))}, ...)")


def refuse_sequence_parallel(name: str, sequence_parallel: bool) -> None:
    if sequence_parallel:
        raise ConfigError(f"--sequence-parallel is not available for the {name} model's TP plan in this version",
                          hint="drop --sequence-parallel (tensor parallelism without it is exact)")


def gpt_tp_plan(config: GPTConfig, index: int, tp: int, *, sequence_parallel: bool = False) -> TPPlan:
    """Block `index`'s plan: decoder layers split as above, embedding (0) and head (last) whole."""
    check_divides(tp, "attention heads", config.nhead, "--tp")
    check_divides(tp, "MLP hidden units", config.mlp_ratio * config.emsize, "--tp")
    refuse_sequence_parallel("lm", sequence_parallel)
    if index in (0, config.num_blocks - 1):
        return None
    return {"qkv": FusedColwiseParallel(3), "proj": RowwiseParallel(),
            "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}

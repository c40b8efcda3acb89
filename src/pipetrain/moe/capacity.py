"""Expert capacity (`--moe-capacity FACTOR`): each expert takes at most so many token-slots of a micro-batch, the
rest are dropped.

Definition (GShard / Switch style, local): the capacity is counted per micro-batch on each data-parallel rank,
before the expert-parallel all-to-all, from the tokens that rank routes: with N tokens, top-k and E experts, each
expert takes at most `ceil(factor * N * k / E)` of that rank's (token, expert) slots. Slots are served first
choices first (every token's first expert, in token order, then every token's second, ...), as GShard serves them.
A dropped slot keeps its place in the expert's input but its combine weight is zero: the expert's output for it
counts for nothing, no gradient reaches the expert or the router's weight through it, and the token keeps its
residual path (a token all of whose slots are dropped passes the layer unchanged). The router's statistics (the
load-balancing loss, the load counts) are the router's choices before dropping.

Because the decision is taken on the routing rank from its own tokens, the dropped slots do not depend on `--ep`:
ep 1 and ep 2 at the same dp and micro-batches drop the same slots. They do depend on the micro-batch size (dp,
--chunks, --batch-size), as GShard's groups do. Under context parallelism a micro-batch's sequences are cut over
the cp ranks: the ranks' choices are gathered and served over the whole sequences in token order
(`workloads.hf.routing.RouterOutputs`), so the slots dropped do not depend on `--cp` either. Default: no capacity,
nothing dropped (as transformers).
"""

from __future__ import annotations

import math

import torch

from pipetrain.errors import ConfigError

__all__ = ["check_capacity", "capacity_of", "within_capacity"]


def check_capacity(factor: float | None) -> None:
    """One ConfigError for a capacity factor that is not a positive finite number (None: no capacity)."""
    if factor is None:
        return
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
        raise ConfigError(f"--moe-capacity {factor!r} is not a positive number",
                          hint="pass a capacity factor such as 1.25 (each expert takes 1.25x its even share of "
                               "token-slots), or drop --moe-capacity to drop nothing")


def capacity_of(tokens: int, top_k: int, experts: int, factor: float) -> int:
    """The token-slots one expert takes of a micro-batch of `tokens` tokens: `ceil(factor * tokens * top_k / E)`."""
    return math.ceil(factor * tokens * top_k / experts)


def within_capacity(top_k_index: torch.Tensor, experts: int, factor: float) -> torch.Tensor:
    """Which slots of `top_k_index` [N, k] each expert takes (bool [N, k]): the first `capacity_of(N, k, E,
    factor)` of its slots in serving order (choice-major: all first choices in token order, then all second)."""
    tokens, top_k = top_k_index.shape
    limit = capacity_of(tokens, top_k, experts, factor)
    served = top_k_index.t().reshape(-1)  # serving order: choice-major
    order = torch.argsort(served, stable=True)
    counts = torch.bincount(served, minlength=experts)
    first = torch.cumsum(counts, 0) - counts  # where each expert's slots start in `order`
    place = torch.empty_like(served)
    place[order] = torch.arange(served.numel(), device=served.device) - first[served[order]]
    return (place < limit).view(top_k, tokens).t()

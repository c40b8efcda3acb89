"""Calibration of expert parallelism's fixed cost per all-to-all: pipetrain's own dispatch and combine, timed.

The planner prices each expert all-to-all as a ring collective: (ep - 1) peers' latency plus (ep - 1) / ep of the
bytes at the collective bandwidth (plan/experts.py). What that leaves out is fixed per call: an all-to-all of uneven
sizes is not the bare all-reduce the network calibration times back to back. A MoE layer's forward makes three
(the counts per expert, then the tokens, then the outputs back: `moe.dispatch`), each a sync point (a host sync for
the split sizes, gloo's pairwise sends and receives, the wait for the slower peer). So the two calibration ranks
time one `dispatch` + `combine` of a micro-batch of one sequence of the planned width (8 experts, top 2, random
routing), each after the same short matmul (so that the ranks drift as in training), and take:

- `ep_all_to_all_s`: (the dispatch and combine's *mean* - the ring's price of their three calls) / 3 calls, per
  peer (ep - 1 = 1 here), which the planner adds per expert all-to-all call and peer. The mean, not the median:
  a step pays every call, the slow ones included.

Called from `bench.calibrate` on its two ranks, after the network figures it uses.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.moe.dispatch import combine, dispatch
from pipetrain.pipeline.clock import clock_for

__all__ = ["ep_figures", "CALLS_FORWARD", "CALLS_BACKWARD"]

#: all-to-all calls a MoE layer makes per micro-batch: counts, tokens and outputs in forward; the outputs' and the
#: tokens' gradients in backward (`moe.dispatch.AllToAll`; the counts have no gradient)
CALLS_FORWARD, CALLS_BACKWARD = 3, 2
_EXPERTS, _TOP_K = 8, 2
_WORK = 96  # the square matmul between two calls


def ep_figures(shape: dict, device: torch.device, figures: dict[str, Any], repeats: int) -> dict[str, float]:
    """{"ep_all_to_all_s": seconds} measured on this rank (the caller takes the ranks' median)."""
    ep = dist.get_world_size()
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(dist.get_rank())
    hidden = torch.randn(shape["seq_len"], shape["emsize"], generator=gen).to(device)
    top_k = torch.stack([torch.randperm(_EXPERTS, generator=gen)[:_TOP_K] for _ in range(shape["seq_len"])]).to(device)
    weights = torch.full(top_k.shape, 1.0 / _TOP_K, device=device)
    work = torch.randn(_WORK, _WORK, device=device)
    clock = clock_for(device)

    def exchange() -> None:
        sent = dispatch(hidden, top_k, _EXPERTS, group)
        combine(sent.tokens, sent, weights)

    times = []
    dist.barrier()
    for index in range(8 * repeats + 2):
        work @ work
        seconds = clock.seconds(exchange)
        if index >= 2:  # warm-up
            times.append(seconds)
    # the ring's price of the three calls (the counts' bytes are negligible): plan/experts.py's formula
    moved = 2 * shape["seq_len"] * _TOP_K * shape["emsize"] * hidden.element_size() * (ep - 1) / ep
    ring = moved / figures["collective_bytes_per_s"] + CALLS_FORWARD * (ep - 1) * figures["collective_latency_s"]
    return {"ep_all_to_all_s": max((statistics.fmean(times) - ring) / CALLS_FORWARD / (ep - 1), 0.0)}

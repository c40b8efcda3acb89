"""Calibration across nodes: the point-to-point and all-reduce figures of the link between ranks of different hosts.

Run inside every rank of a job that spans nodes (torchrun or Slurm set its variables): the first rank of each
node (its leader) measures, the others wait. Rank 0 and the leader of the next node ping-pong tensors of 4 KB
and up (latency and bandwidth from a least-squares line, as on one node); the leaders all-reduce the same sizes
(ring volume 2 (n-1)/n bytes per element). Sizes grow until a one-way transfer takes `slow_s` (so a link
throttled to a few Mbit/s costs seconds, not minutes; rank 0 decides and tells the others). Rank 0 gets the
figures; `pipetrain plan --calibrate` stores them as the calibration's inter-node link.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from pipetrain.launch.env import ClusterEnv, restore_environ
from pipetrain.launch.ranks import RankSpec

__all__ = ["measure_inter_node", "inter_node_figures", "INTER_SIZES"]

#: float32 elements: 4 KB .. 64 MB (the larger ones only while a transfer stays under `slow_s`).
INTER_SIZES = (1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22, 1 << 24)
_MIN_SIZES = 3


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept (clamped at 1 µs) and slope (at worst the largest point's through the origin)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    if slope <= 0:
        slope = ys[-1] / xs[-1]
    return max(my - slope * mx, 1e-6), slope


def _timed(fn, repeats: int, device: torch.device) -> float:
    """The median seconds of `fn` (after a warm-up call: TCP windows, the backend's buffers), synchronised on CUDA."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _go_on(seconds: float, leaders: dist.ProcessGroup, slow_s: float, measured: int, device: torch.device) -> bool:
    """Rank 0's decision (told to the other leaders) whether to measure the next size."""
    flag = torch.tensor([1 if measured < _MIN_SIZES or seconds < slow_s else 0], device=device)
    dist.broadcast(flag, src=0, group=leaders)
    return bool(flag.item())


def inter_node_figures(nodes_of_ranks: list[int], repeats: int = 5, slow_s: float = 0.25,
                       device: torch.device = torch.device("cpu")) -> dict[str, float] | None:
    """Measure with the joined world whose rank r runs on node `nodes_of_ranks[r]` (every rank calls this; tensors
    on `device`); the figures on rank 0, None elsewhere. Needs two nodes at least."""
    rank = dist.get_rank()
    leaders = sorted({nodes_of_ranks.index(node) for node in set(nodes_of_ranks)})
    if len(leaders) < 2:
        raise ValueError(f"the job runs on one node (ranks' nodes {nodes_of_ranks}): nothing crosses nodes")
    group = dist.new_group(leaders)  # every rank takes part in making it
    peer = leaders[1]
    if rank not in leaders:
        dist.barrier()
        return None
    sizes, p2p, reduce = [], [], []
    for n in INTER_SIZES:
        t = torch.ones(n, device=device)

        def ping() -> None:
            if rank == 0:
                dist.send(t, peer)
                dist.recv(t, peer)
            elif rank == peer:
                dist.recv(t, 0)
                dist.send(t, 0)

        one_way = _timed(ping, repeats, device) / 2 if rank in (0, peer) else 0.0
        reduce.append(_timed(lambda: dist.all_reduce(t, group=group), repeats, device))
        sizes.append(n)
        p2p.append(one_way)
        if not _go_on(max(one_way, reduce[-1] / 2), group, slow_s, len(sizes), device):
            break
    dist.barrier()
    if rank != 0:
        return None
    k = len(leaders)
    nbytes = [4.0 * n for n in sizes]
    p2p_lat, p2p_slope = _line(nbytes, p2p)
    ar_lat, ar_slope = _line([b * 2 * (k - 1) / k for b in nbytes], reduce)
    return {"inter_latency_s": p2p_lat, "inter_bytes_per_s": 1 / p2p_slope,
            "inter_collective_latency_s": ar_lat / (2 * (k - 1)), "inter_collective_bytes_per_s": 1 / ar_slope,
            "inter_nodes": float(k), "inter_largest_bytes": nbytes[-1]}


def measure_inter_node(env: ClusterEnv, *, device: str | None = None, repeats: int = 5) -> dict[str, float] | None:
    """Join the job `env` describes (`device` as for training: gloo on "cpu", NCCL on "cuda"), measure the link
    between its nodes, leave the job; the figures on rank 0, None on the other ranks."""
    from pipetrain.session import join_job  # the session's join: interface variables, bounded wait for rank 0

    spec = RankSpec(env.rank, env.local_rank, env.world_size, env.master_addr, env.master_port, device, env.num_nodes)
    with restore_environ():  # the interface variables join_job exports are for this job only
        joined = join_job(spec)
        try:
            nodes: list = [None] * env.world_size
            dist.all_gather_object(nodes, env.node_rank)
            return inter_node_figures(nodes, repeats, device=joined)
        finally:
            dist.destroy_process_group()

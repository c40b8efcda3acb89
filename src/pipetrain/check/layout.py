"""The parallel side of `pipetrain check`: the layout's ranks run the same steps and record what they hold.

Ranks get the job's `TrainConfig` (they load the workload again from its name or import path) and the global
batches as tensors; each replica takes its contiguous share of every batch. Each rank writes
`rank<N>.pt`: its losses, and after each step the gradients and parameters it holds under the unsplit
model's names (DTensor shards and expert-parallel slices gathered), and the names of those its tensor-parallel plan split.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from pipetrain.check.reference import QuietModel
from pipetrain.launch.env import free_port
from pipetrain.launch.spawn import RankSpec, spawn
from pipetrain.parallel.experts import expert_layout, gather_experts, is_expert
from pipetrain.session import build_session, close_session, join_job

__all__ = ["layout_runs"]


def _full(t: torch.Tensor | None, experts: dist.ProcessGroup | None = None,
          layout: tuple[int, int] = (0, 1)) -> torch.Tensor | None:
    """`t` whole on the CPU: a DTensor's full tensor; with `experts` (an expert parameter's expert-parallel group)
    every rank's slice of the layer's experts (placed by the parameter's `layout`: `expert_layout`)."""
    if t is None:
        return None
    t = (t.full_tensor() if isinstance(t, DTensor) else t).detach()
    dim, parts = layout
    return (gather_experts(t, experts, dim=dim, parts=parts) if experts is not None else t).cpu().clone()


def _whole(engine, tensors) -> dict[str, torch.Tensor | None]:
    """name -> each parameter's `tensors(param)` whole (expert slices gathered over the expert-parallel group)."""
    group = engine.expert_group
    return {name: _full(tensors(p), group if group is not None and is_expert(p) else None, expert_layout(p))
            for name, p in engine.named_parameters()}


def _on_tp(param: torch.Tensor) -> bool:
    """Whether `param` is split by the model's tensor-parallel plan (a DTensor sharded along the mesh's `tp` axis;
    one replicated there, e.g. a row-parallel bias, is not)."""
    names = param.device_mesh.mesh_dim_names or () if isinstance(param, DTensor) else ()
    if "tp" not in names:
        return False
    placement = param.placements[names.index("tp")]  # Shard, or the strided split of a fused projection
    return not (placement.is_replicate() or placement.is_partial())


def _share(x, part: slice):
    return tuple(t[part] for t in x) if isinstance(x, tuple) else x[part]


def _rank(spec: RankSpec, jobs: list[tuple], lr: float, out: str) -> None:
    device = join_job(spec)
    try:
        records = [_record(config, batches, lr, device) for config, batches in jobs]
        torch.save(records, Path(out) / f"rank{spec.rank}.pt")
    finally:
        close_session()


def _record(config, batches: list, lr: float, device: torch.device) -> dict:
    workload = config.task()
    session = build_session(QuietModel(config.model()), config.parallel, device, seed=config.seed,
                            loss_fn=workload.loss(), precision=config.precision)
    engine, dp, dp_rank = session.engine, config.parallel.dp, session.mesh.dp_rank
    optimizer = torch.optim.SGD(engine.parameters(), lr=lr)
    record: dict = {"losses": [], "grads": [], "params": [], "balance": tuple(engine.balance),
                    "tp_split": sorted(name for name, p in engine.named_parameters() if _on_tp(p))}
    for x, y in batches:
        share = y.shape[0] // dp
        part = slice(dp_rank * share, (dp_rank + 1) * share)
        optimizer.zero_grad(set_to_none=True)
        record["losses"].append(engine.step(_share(x, part), y[part]).loss)
        record["grads"].append(_whole(engine, lambda p: p.grad))
        optimizer.step()
        record["params"].append(_whole(engine, lambda p: p))
    return record


def layout_runs(jobs: list[tuple], *, lr: float, out: Path, timeout_s: float | None = 900.0) -> list[list[dict]]:
    """Run each `(config, batches)` of `jobs` in turn (layouts of one world size) on one spawned set of local
    ranks, a fresh mesh and engine each; returns, per job, each rank's record."""
    world = jobs[0][0].parallel.world_size
    spawn(_rank, ranks=range(world), world_size=world, master_addr="127.0.0.1", master_port=free_port(),
          args=(jobs, lr, str(out)), timeout_s=timeout_s)
    per_rank = [torch.load(out / f"rank{r}.pt") for r in range(world)]
    return [[records[job] for records in per_rank] for job in range(len(jobs))]

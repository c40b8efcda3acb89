"""Calibration of tensor parallelism's fixed costs on two ranks: a DTensor collective and a DTensor optimizer step.

The planner prices a split layer as its share of the compute plus the ring all-reduces of Megatron's count
(plan/tensor.py). What that leaves out is fixed per call, and at the sizes a CPU runs it dominates:

- `tp_collective_s`: a TP all-reduce is not the bare ring `dist.all_reduce` the network calibration times
  back to back: it goes through DTensor (`from_local(Partial)` -> `redistribute(Replicate)`: placement
  logic, the functional collective, its wait) between the rank's own work, and it waits for the slower
  peer. The ranks time, in alternation, a bare all-reduce and the DTensor one of the same small tensor,
  each after the same short matmul (so that they drift as in training); the figure is the DTensor call's
  *mean* (a step pays every call, the slow ones included) minus the bare call's median. A trace of a tp2
  run (`--trace`, TP spans) shows the same order per all-reduce (docs/tracing.md).
- `optimizer_s_per_dtensor`: one encoder layer of the planned shape split by the classifier's TP plan
  (`tensor_parallel_blocks`, the engine's own path) and the same layer unsplit, an AdamW step over each,
  in alternation: the median difference per DTensor parameter. An optimizer step over DTensors runs every
  elementwise operation through DTensor's dispatch (and the head-strided QKV weights' redistributions);
  FSDP2's sharded parameters are DTensors too (plan/times.py `optimizer_s`).

Called from `bench.calibrate` on its two ranks.
"""

from __future__ import annotations

import statistics
import torch
import torch.distributed as dist

from pipetrain.parallel.tensor import tensor_parallel_blocks
from pipetrain.pipeline.clock import clock_for
from pipetrain.workloads.classifier.presets import TransformerConfig
from pipetrain.workloads.classifier.model import TransformerClassifier

__all__ = ["tp_figures"]

_NUMEL = 1 << 12  # 16 KB: one sample of the cpu preset's (s, h) activation, where the fixed cost dominates
_WORK = 96  # the square matmul between two calls


def tp_figures(shape: dict, device: torch.device, repeats: int) -> dict[str, float]:
    """{"tp_collective_s", "optimizer_s_per_dtensor"} measured on this rank (the caller takes the ranks' median)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    tp = dist.get_world_size()
    mesh = init_device_mesh(device.type, (tp,), mesh_dim_names=("tp",))
    clock = clock_for(device)
    x = torch.ones(_NUMEL, device=device)
    work = torch.randn(_WORK, _WORK, device=device)

    def bare() -> None:
        dist.all_reduce(x)

    def dtensor() -> None:
        DTensor.from_local(x, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()

    model = TransformerClassifier(TransformerConfig(vocab_size=2, nlayers=1, **{"dropout": 0.1, **shape}))
    plain = model.layer().to(device)
    split = tensor_parallel_blocks(model, mesh)(1, model.layer().to(device))
    for layer in (plain, split):
        for p in layer.parameters():
            p.grad = torch.zeros_like(p)
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-6)
    opt_split = torch.optim.AdamW(split.parameters(), lr=1e-6)
    times: dict[str, list[float]] = {"bare": [], "dtensor": [], "opt_plain": [], "opt_split": []}
    dist.barrier()
    for index in range(8 * repeats + 2):
        for name, fn in (("bare", bare), ("dtensor", dtensor), ("opt_plain", opt_plain.step), ("opt_split", opt_split.step)):
            work @ work
            seconds = clock.seconds(fn)
            if index >= 2:  # warm-up
                times[name].append(seconds)
    dtensors = sum(isinstance(p, DTensor) for p in split.parameters())
    extra = statistics.median(s - p for s, p in zip(times["opt_split"], times["opt_plain"])) / max(dtensors, 1)
    return {"tp_collective_s": max(statistics.fmean(times["dtensor"]) - statistics.median(times["bare"]), 0.0),
            "optimizer_s_per_dtensor": max(extra, 0.0)}

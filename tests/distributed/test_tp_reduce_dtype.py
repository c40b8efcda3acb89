"""pytorch #190626 on pipetrain's path: under FSDP2 with tensor parallelism and a bf16 `param_dtype`, torch may run the
tensor-parallel all-reduce of replicated parameters' gradients (the norms under sequence parallelism) in bf16, before
FSDP2's fp32 `reduce_dtype` applies. One 4-rank job (dp 2 × tp 2, FSDP2, `--precision bf16`, sequence parallelism, the
`lm` decoder and the classifier) records the dtype of every DTensor all-reduce on the tp mesh during a training step
(through `compat.dtensor.wrapped_placement_methods`, the hook the trace uses); those of tensors shaped like a
TP-replicated parameter (the norms' weights and biases: the gradients this bug is about) must be fp32.
Measured on torch 2.13: they are (autocast runs LayerNorm in fp32, so those gradients reach the all-reduce as fp32):
pipetrain is not affected and does no fp32 reduction of its own. The Hugging Face families have no sequence
parallelism in pipetrain (their norms stay whole on every TP rank: no all-reduce of their gradients at all)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

from pipetrain.compat.dtensor import wrapped_placement_methods
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.launch.env import free_port
from pipetrain.launch.spawn import RankSpec, spawn
from pipetrain.pipeline import TokenCrossEntropy
from pipetrain.session import build_session, close_session, join_job
from tests.distributed.harness import make_batches, make_gpt, make_model, make_token_batches

MODELS = {"gpt": (make_gpt, TokenCrossEntropy, make_token_batches),
          "classifier": (make_model, lambda: F.cross_entropy, make_batches)}


def _job(spec: RankSpec, out: str) -> None:
    device = join_job(spec)
    try:
        records = {}
        for name, (factory, loss, batches) in MODELS.items():
            parallel = ParallelConfig(dp=2, dp_mode="fsdp", tp=2, sequence_parallel=True,
                                      pipeline=PipelineConfig(pp=1, schedule="gpipe", n_microbatches=2))
            session = build_session(factory(), parallel, device, seed=0, loss_fn=loss(), precision="bf16")
            replicated = {tuple(p.shape) for p in session.engine.parameters()
                          if isinstance(p, DTensor) and isinstance(p.placements[-1], Replicate)}
            seen: list[tuple[str, list[int]]] = []

            def wrap(method, kind):
                def run(placement, tensor, mesh, *args, **kwargs):
                    if kind == "tp_all_reduce" and "tp" in (mesh.mesh_dim_names or ()):
                        seen.append((str(tensor.dtype), list(tensor.shape)))
                    return method(placement, tensor, mesh, *args, **kwargs)
                return run

            (x, y), = batches([8])
            part = slice(session.mesh.dp_rank * 4, session.mesh.dp_rank * 4 + 4)
            with wrapped_placement_methods(wrap):
                session.engine.step(x[part], y[part])
            records[name] = {"seen": seen, "replicated": sorted(map(list, replicated))}
        (Path(out) / f"rank{spec.rank}.json").write_text(json.dumps(records))
    finally:
        close_session()


def test_replicated_gradients_reduce_over_tp_in_fp32(tmp_path):
    spawn(_job, ranks=range(4), world_size=4, master_addr="127.0.0.1", master_port=free_port(),
          args=(str(tmp_path),), timeout_s=600)
    for rank in range(4):
        for name, record in json.loads((tmp_path / f"rank{rank}.json").read_text()).items():
            replicated = {tuple(shape) for shape in record["replicated"]}
            gradients = [dtype for dtype, shape in record["seen"] if tuple(shape) in replicated]
            assert gradients, f"{name}: no all-reduce of a replicated parameter's gradient was seen"
            assert set(gradients) == {str(torch.float32)}, f"{name} rank {rank}: {gradients}"

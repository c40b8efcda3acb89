"""Parity harness: runs a few optimizer steps on spawned gloo ranks and on one process, for comparison."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from pipetrain.blocks import build_sequential
from pipetrain.config import ParallelConfig
from pipetrain.launch.env import free_port
from pipetrain.launch.spawn import RankSpec, spawn
from pipetrain.session import close_session, open_session
from pipetrain.workloads.transformer import PRESETS, TransformerClassifier

SEED = 3
LR = 0.05


# the tiny preset with 6 encoder layers: 8 blocks, enough for pp=4 with 2 virtual stages per rank
MODEL_CONFIG = replace(PRESETS["tiny"], nlayers=6)


def make_model() -> TransformerClassifier:
    return TransformerClassifier(MODEL_CONFIG)


def make_batches(sizes: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic token batches (the last may be short)."""
    gen = torch.Generator().manual_seed(7)
    cfg = MODEL_CONFIG
    return [
        (torch.randint(0, cfg.vocab_size, (n, cfg.seq_len), generator=gen), torch.randint(0, 2, (n,), generator=gen))
        for n in sizes
    ]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def reference_run(batches) -> dict:
    """Single process, whole batch, plain mean loss: the ground truth."""
    torch.manual_seed(0)
    model = build_sequential(make_model(), seed=SEED)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    for x, y in batches:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _worker(spec: RankSpec, parallel: ParallelConfig, batches, out: str) -> None:
    torch.manual_seed(0)
    session = open_session(spec, make_model(), parallel, seed=SEED)
    try:
        engine, mesh = session.engine, session.mesh
        opt = torch.optim.SGD(engine.parameters(), lr=LR)
        losses, grads = [], []
        for x, y in batches:
            n = x.shape[0] // parallel.dp
            part = slice(mesh.dp_rank * n, (mesh.dp_rank + 1) * n)
            opt.zero_grad()
            result = engine.step(x[part], y[part], global_batch_size=n * parallel.dp)
            losses.append(result.loss)
            grads.append({name: _full(p.grad).clone() for name, p in engine.named_parameters()})
            opt.step()
        params = {name: _full(p.detach()).clone() for name, p in engine.named_parameters()}
        torch.save({"losses": losses, "grads": grads, "params": params}, Path(out) / f"rank{spec.rank}.pt")
    finally:
        close_session()


def parallel_run(parallel: ParallelConfig, batches, out: Path) -> list[dict]:
    """The same steps on dp × pp spawned ranks; returns each rank's record."""
    world = parallel.world_size
    spawn(_worker, ranks=range(world), world_size=world, master_addr="127.0.0.1", master_port=free_port(),
          args=(parallel, batches, str(out)))
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


def assert_parity(ref: dict, records: list[dict], *, rtol: float, atol: float) -> None:
    """Every rank reports the reference losses; every parameter's gradients and final values match."""
    seen = set()
    for record in records:
        torch.testing.assert_close(torch.tensor(record["losses"]), torch.tensor(ref["losses"]), rtol=rtol, atol=atol)
        for step, grads in enumerate(record["grads"]):
            for name, grad in grads.items():
                torch.testing.assert_close(grad, ref["grads"][step][name], rtol=rtol, atol=atol,
                                           msg=lambda m: f"step {step} grad {name}: {m}")
        for name, value in record["params"].items():
            torch.testing.assert_close(value, ref["params"][name], rtol=rtol, atol=atol, msg=lambda m: f"param {name}: {m}")
            seen.add(name)
    missing = set(ref["params"]) - seen
    if missing:
        raise AssertionError(f"parameters held by no rank: {sorted(missing)}")

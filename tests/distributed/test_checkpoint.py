"""Checkpoints through the Python API: exact resume under the same layout, and resume under other layouts.

Two spawned jobs (2 and 4 ranks) run every case in turn. A case trains STEPS steps with AdamW under one
layout, saving after step SAVE_AT; a resumed case loads that checkpoint under another layout and trains the
remaining steps. Same layout: the resumed losses equal the uninterrupted ones bitwise (CPU, same order of
float operations). Another layout: within the parity tolerance (rtol 1e-5, atol 4e-5, see test_parity.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipetrain.blocks import build_sequential
from pipetrain.checkpoint import export_checkpoint, load_checkpoint, save_checkpoint
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.errors import ConfigError
from pipetrain.launch.env import free_port
from pipetrain.launch.spawn import RankSpec, spawn
from pipetrain.session import build_session, close_session, join_job
from tests.distributed.harness import SEED, make_batches, make_model

RTOL, ATOL = 1e-5, 4e-5
STEPS, SAVE_AT = 4, 2
BATCHES = [8] * STEPS


def _layout(pp: int, schedule: str = "1f1b", dp: int = 1, dp_mode: str = "ddp", balance=None, chunks: int = 4,
            **parallel) -> ParallelConfig:
    pipeline = PipelineConfig(pp=pp, schedule=schedule, n_microbatches=chunks, balance=balance)
    return ParallelConfig(dp=dp, dp_mode=dp_mode, pipeline=pipeline, **parallel)


# name -> (layout, checkpoint to resume from or None); writers save after SAVE_AT into <out>/<name>
WORLD_CASES = {
    2: {
        "pp2-gpipe": (_layout(2, "gpipe"), None),
        "pp2-1f1b": (_layout(2, "1f1b"), None),
        "pp2-interleaved": (_layout(2, "interleaved-1f1b"), None),
        "dp2-ddp": (_layout(1, "gpipe", dp=2), None),
        "dp2-fsdp": (_layout(1, "gpipe", dp=2, dp_mode="fsdp"), None),
        "pp2-gpipe<-pp2-gpipe": (_layout(2, "gpipe"), "pp2-gpipe"),
        "pp2-1f1b<-pp2-1f1b": (_layout(2, "1f1b"), "pp2-1f1b"),
        "pp2-interleaved<-pp2-interleaved": (_layout(2, "interleaved-1f1b"), "pp2-interleaved"),
        "pp2-interleaved<-pp2-1f1b": (_layout(2, "interleaved-1f1b"), "pp2-1f1b"),
        "pp2-balance-5-3<-pp2-1f1b": (_layout(2, "1f1b", balance=(5, 3)), "pp2-1f1b"),
        "pp2-zbv": (_layout(2, "zbv"), None),  # V placement: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2
        "pp2-zbv<-pp2-zbv": (_layout(2, "zbv"), "pp2-zbv"),
        "pp2-zbv<-pp2-1f1b": (_layout(2, "zbv"), "pp2-1f1b"),
        "pp2-1f1b<-pp2-zbv": (_layout(2, "1f1b"), "pp2-zbv"),
        "dp2-fsdp<-dp2-ddp": (_layout(1, "gpipe", dp=2, dp_mode="fsdp"), "dp2-ddp"),
        "dp2-ddp<-dp2-fsdp": (_layout(1, "gpipe", dp=2), "dp2-fsdp"),
    },
    4: {
        "pp4<-pp2-1f1b": (_layout(4, "1f1b"), "pp2-1f1b"),
        "dp2xpp2-fsdp<-pp2-1f1b": (_layout(2, "1f1b", dp=2, dp_mode="fsdp"), "pp2-1f1b"),
        "dp2xpp2-ddp-interleaved<-dp2-fsdp": (_layout(2, "interleaved-1f1b", dp=2), "dp2-fsdp"),
        # HSDP (2 replicas of 2-rank shard groups) writes and reads the same layout-free checkpoints
        "dp4-hsdp": (_layout(1, "gpipe", dp=4, dp_mode="hsdp", dp_shard=2, chunks=2), None),
        "dp4-hsdp<-pp2-1f1b": (_layout(1, "gpipe", dp=4, dp_mode="hsdp", dp_shard=2, chunks=2), "pp2-1f1b"),
        "dp2xpp2-fsdp-reshard<-dp4-hsdp": (_layout(2, "1f1b", dp=2, dp_mode="fsdp", fsdp_reshard="always"),
                                           "dp4-hsdp"),
    },
}


def _case(name: str, parallel: ParallelConfig, source: str | None, out: Path, device: torch.device) -> list[float]:
    session = build_session(make_model(), parallel, device, seed=SEED if source is None else SEED + 1)
    engine, mesh = session.engine, session.mesh
    optimizer = torch.optim.AdamW(engine.parameters(), lr=0.01)
    first = 0
    if source is not None:
        meta = load_checkpoint(out / source, engine, optimizer, model_name="tiny6")
        first = meta.extras["next_step"]
    losses = []
    for step, (x, y) in enumerate(make_batches(BATCHES)[first:], start=first):
        share = x.shape[0] // parallel.dp
        part = slice(mesh.dp_rank * share, (mesh.dp_rank + 1) * share)
        optimizer.zero_grad()
        losses.append(engine.step(x[part], y[part]).loss)
        optimizer.step()
        if source is None and step + 1 == SAVE_AT:
            save_checkpoint(out / name, engine, optimizer, step=step + 1, model_name="tiny6",
                            extras={"next_step": step + 1}, keep=1)
            outputs = engine.evaluate(*make_batches([4])[0]).outputs  # what an export must reproduce
            if outputs is not None and mesh.dp_rank == 0:
                torch.save(outputs, out / f"outputs-{name}.pt")
    return losses


def _worker(spec: RankSpec, cases: dict, out: str) -> None:
    device = join_job(spec)
    try:
        losses = {name: _case(name, parallel, source, Path(out), device) for name, (parallel, source) in cases.items()}
        if spec.rank == 0:
            (Path(out) / f"losses-{spec.world_size}.json").write_text(json.dumps(losses))
    finally:
        close_session()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict[str, list[float]], Path]:
    out = tmp_path_factory.mktemp("checkpoints")
    losses = {}
    for world, cases in WORLD_CASES.items():
        spawn(_worker, ranks=range(world), world_size=world, master_addr="127.0.0.1", master_port=free_port(),
              args=(cases, str(out)), timeout_s=300)
        losses.update(json.loads((out / f"losses-{world}.json").read_text()))
    return losses, out


SAME = [name for cases in WORLD_CASES.values() for name, (_, s) in cases.items() if s and name.split("<-")[0] == s]
OTHER = [name for cases in WORLD_CASES.values() for name, (_, s) in cases.items() if s and name not in SAME]


@pytest.mark.parametrize("name", SAME)
def test_resume_same_layout_is_bitwise_exact(name, runs):
    losses, _ = runs
    source = name.split("<-")[1]
    assert len(losses[name]) == STEPS - SAVE_AT
    assert losses[name] == losses[source][SAVE_AT:]


@pytest.mark.parametrize("name", OTHER)
def test_resume_under_another_layout_continues_the_losses(name, runs):
    losses, _ = runs
    source = name.split("<-")[1]
    torch.testing.assert_close(torch.tensor(losses[name]), torch.tensor(losses[source][SAVE_AT:]), rtol=RTOL, atol=ATOL)


def test_only_the_committed_checkpoint_is_kept(runs):
    _, out = runs
    assert sorted(p.name for p in (out / "pp2-1f1b").iterdir()) == [f"step-{SAVE_AT:08d}"]


def test_export_loads_into_plain_sequential(runs, tmp_path):
    _, out = runs
    for name in ("dp2-fsdp", "pp2-interleaved"):
        export_checkpoint(out / name, make_model(), tmp_path / f"{name}.pt")
        model = build_sequential(make_model(), seed=99).eval()  # other initial weights: all must be overwritten
        model.load_state_dict(torch.load(tmp_path / f"{name}.pt", weights_only=True))
        with torch.no_grad():
            outputs = model(make_batches([4])[0][0])
        torch.testing.assert_close(outputs, torch.load(out / f"outputs-{name}.pt"), rtol=RTOL, atol=ATOL)


def test_export_refuses_another_model(runs, tmp_path):
    from dataclasses import replace

    from pipetrain.workloads.classifier.model import TransformerClassifier
    from tests.distributed.harness import MODEL_CONFIG

    _, out = runs
    with pytest.raises(ConfigError, match="another shape"):
        export_checkpoint(out / "pp2-1f1b", TransformerClassifier(replace(MODEL_CONFIG, nlayers=2)), tmp_path / "m.pt")

"""Checkpoints across tensor-parallel degrees: written at pp2 × tp2, resumed at pp4 (tp1) and at dp2 × tp2 FSDP2,
and back (pp2 × tp2 from a dp2 × tp2 FSDP2 checkpoint); `export` of a TP checkpoint is the unsplit model.

One spawned 4-rank job runs the cases of test_checkpoint.py's worker (AdamW, save after step 2 of 4). Another
layout continues the uninterrupted run's losses within the parity tolerance (rtol 1e-5, atol 4e-5).
"""

from __future__ import annotations

import json

import pytest
import torch

from pipetrain.blocks import build_sequential
from pipetrain.checkpoint import export_checkpoint
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.launch.env import free_port
from pipetrain.launch.spawn import spawn
from tests.distributed.harness import make_batches, make_model
from tests.distributed.test_checkpoint import SAVE_AT, _worker

RTOL, ATOL = 1e-5, 4e-5


def _layout(pp: int, tp: int, dp: int = 1) -> ParallelConfig:
    return ParallelConfig(dp=dp, tp=tp, dp_mode="fsdp", pipeline=PipelineConfig(pp=pp, schedule="1f1b", n_microbatches=4))


# name -> (layout, checkpoint to resume from or None), in the order the job runs them
CASES = {
    "pp2xtp2": (_layout(2, 2), None),
    "dp2xtp2-fsdp": (_layout(1, 2, dp=2), None),
    "pp4<-pp2xtp2": (_layout(4, 1), "pp2xtp2"),
    "dp2xtp2-fsdp<-pp2xtp2": (_layout(1, 2, dp=2), "pp2xtp2"),
    "pp2xtp2<-dp2xtp2-fsdp": (_layout(2, 2), "dp2xtp2-fsdp"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp-checkpoints")
    spawn(_worker, ranks=range(4), world_size=4, master_addr="127.0.0.1", master_port=free_port(),
          args=(CASES, str(out)), timeout_s=600)
    return json.loads((out / "losses-4.json").read_text()), out


@pytest.mark.parametrize("name", [name for name, (_, source) in CASES.items() if source])
def test_resume_across_tp_degrees_continues_the_losses(name, runs):
    losses, _ = runs
    source = name.split("<-")[1]
    assert len(losses[name]) == len(losses[source]) - SAVE_AT
    torch.testing.assert_close(torch.tensor(losses[name]), torch.tensor(losses[source][SAVE_AT:]), rtol=RTOL, atol=ATOL)


def test_export_of_a_tp_checkpoint_is_the_unsplit_model(runs, tmp_path):
    _, out = runs
    for name in ("pp2xtp2", "dp2xtp2-fsdp"):
        weights = export_checkpoint(out / name, make_model(), tmp_path / f"{name}.pt")
        assert weights["1.self_attn.in_proj_weight"].shape == (96, 32)  # the fused q, k, v whole
        model = build_sequential(make_model(), seed=99).eval()  # other initial weights: all must be overwritten
        model.load_state_dict(torch.load(tmp_path / f"{name}.pt", weights_only=True))
        with torch.no_grad():
            outputs = model(make_batches([4])[0][0])
        torch.testing.assert_close(outputs, torch.load(out / f"outputs-{name}.pt"), rtol=RTOL, atol=ATOL)

"""Tensor parallelism is transparent: tp2, pp2 × tp2, dp2 × tp2 (FSDP2) and dp2 × pp2 × tp2 runs give the losses,
gradients and parameters of one process, with and without sequence parallelism and with the lm's
vocabulary-parallel head (loss_parallel), and the global gradient-norm clip equals the unsplit model's; and
checkpoints cross TP degrees: written at pp2 × tp2, resumed at pp4 (tp1) and at dp2 × tp2 FSDP2, and back
(pp2 × tp2 from a dp2 × tp2 FSDP2 checkpoint); `export` of a TP checkpoint is the unsplit model.

One spawned job per world size (2, 4, 8) runs every case (see harness.py); the 4-rank job also runs the
checkpoint cases (test_checkpoint.py's, AdamW, saved after step 2 of 4). Tolerance in fp32: rtol 1e-5,
atol 4e-5 (the other parity tests': sums in another order, 3 SGD steps). bf16 cases: the split run, and the
single process under the same autocast, each within the bf16 error budget of the fp32 single process
(tests/tolerances.py: ||x - x_fp32|| <= 3 (u + rho) sqrt(D) scale, u = 2^-8, D the rounding stages on the path,
8 a layer under TP, 12 with FSDP2's bf16 parameters, doubled for gradients; scale ||x||, for gradients
||g|| + sqrt(sum_b ||g_b||^2) over the samples): nothing read off one CPU, so it holds under every
ATEN_CPU_CAPABILITY; observed / bound at most 0.26 (docs/testing.md). A shard swapped between the tp ranks is
far outside it (5 to 6.5 times the bound). A resume under another layout continues the uninterrupted losses
within rtol 1e-5, atol 4e-5.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipetrain.blocks import build_sequential
from pipetrain.checkpoint import export_checkpoint
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.launch.env import free_port
from pipetrain.launch.spawn import RankSpec, spawn
from pipetrain.session import close_session, join_job
from tests.distributed import harness
from tests.distributed.harness import (LR, assert_parity, bf16_stages, make_batches, make_model, make_token_batches,
                                       parallel_runs, reference_run)
from tests.distributed.test_checkpoint import SAVE_AT, _case
from tests.tolerances import assert_bf16_parity

# a ceiling, not a measure: each job starts in its first test's setup, on 2 cores shared with other work
pytestmark = pytest.mark.timeout(600)

RTOL, ATOL = 1e-5, 4e-5
CLIP = 0.5  # below the tiny models' gradient norms (about 1 to 3): every step is clipped
BATCHES = [8, 6, 3]  # a short last batch
SHORT = [8, 3]
DP_BATCHES = [16, 12, 6]


def _tp(tp: int = 2, pp: int = 1, schedule: str = "gpipe", dp: int = 1, chunks: int = 2, *, sp: bool = False,
        vocab: bool = False) -> ParallelConfig:
    return ParallelConfig(tp=tp, dp=dp, dp_mode="fsdp", sequence_parallel=sp, loss_parallel=vocab,
                          pipeline=PipelineConfig(pp=pp, schedule=schedule, n_microbatches=chunks))


# name -> (world size, mesh, model, batch sizes, precision, clip)
CASES = {
    "tp2-classifier-clip": (2, _tp(), "classifier", BATCHES, "fp32", CLIP),
    "pp2xtp2-gpipe-classifier": (4, _tp(pp=2), "classifier", BATCHES, "fp32", None),
    "pp2xtp2-1f1b-gpt-clip": (4, _tp(pp=2, schedule="1f1b"), "gpt", BATCHES, "fp32", CLIP),
    "dp2xtp2-fsdp-gpt-clip": (4, _tp(dp=2), "gpt", DP_BATCHES, "fp32", CLIP),
    "dp2xtp2-fsdp-classifier-bf16": (4, _tp(dp=2), "classifier", DP_BATCHES, "bf16", None),
    # sequence parallelism (sp) and the lm's vocabulary-parallel head (vocab): the stages exchange sequence shards
    # (virtual stages too); the clip counts the sequence-parallel norms' (Partial) gradients once. The two
    # classifier cases take two steps (the second short) to spare the suite's time; the lm cases took the places
    # of plain tp2 and interleaved lm cases (the lm's plain plan runs at pp2 × tp2, dp2 × tp2, dp2 × pp2 × tp2)
    "tp2-sp-classifier-clip": (2, _tp(sp=True), "classifier", SHORT, "fp32", CLIP),
    "tp2-sp-vocab-gpt-bf16": (2, _tp(sp=True, vocab=True), "gpt", BATCHES, "bf16", None),
    "pp2xtp2-gpipe-sp-classifier-bf16": (4, _tp(pp=2, sp=True), "classifier", SHORT, "bf16", None),
    "pp2xtp2-interleaved-1f1b-sp-vocab-gpt-clip": (4, _tp(pp=2, schedule="interleaved-1f1b", sp=True, vocab=True),
                                                   "gpt", BATCHES, "fp32", CLIP),
    # the one 8-rank job (slow on 2 cores): two steps, the second a short batch
    "dp2xpp2xtp2-fsdp-1f1b-gpt-clip": (8, _tp(dp=2, pp=2, schedule="1f1b"), "gpt", [16, 12], "fp32", CLIP),
}


def _batches(model: str, sizes: list[int]):
    return make_batches(sizes) if model == "classifier" else make_token_batches(sizes)


def _ckpt_layout(pp: int, tp: int, dp: int = 1) -> ParallelConfig:
    return ParallelConfig(dp=dp, tp=tp, dp_mode="fsdp", pipeline=PipelineConfig(pp=pp, schedule="1f1b", n_microbatches=4))


# checkpoint cases (4 ranks): name -> (layout, checkpoint to resume from or None), in the order they run
CHECKPOINT_CASES = {
    "pp2xtp2": (_ckpt_layout(2, 2), None),
    "dp2xtp2-fsdp": (_ckpt_layout(1, 2, dp=2), None),
    "pp4<-pp2xtp2": (_ckpt_layout(4, 1), "pp2xtp2"),
    "dp2xtp2-fsdp<-pp2xtp2": (_ckpt_layout(1, 2, dp=2), "pp2xtp2"),
    "pp2xtp2<-dp2xtp2-fsdp": (_ckpt_layout(2, 2), "dp2xtp2-fsdp"),
}


def _world4(spec: RankSpec, cases: dict, checkpoint_cases: dict, out: str) -> None:
    """The 4-rank job: the parity cases (harness records), then the checkpoint cases (losses on rank 0)."""
    device = join_job(spec)
    try:
        records = {name: harness._train(parallel, batches, device, *rest) for name, (parallel, batches, *rest) in cases.items()}
        torch.save(records, Path(out) / f"rank{spec.rank}.pt")
        losses = {name: _case(name, parallel, source, Path(out), device)
                  for name, (parallel, source) in checkpoint_cases.items()}
        if spec.rank == 0:
            (Path(out) / "losses-4.json").write_text(json.dumps(losses))
    finally:
        close_session()


def _runs(world: int) -> dict:
    return {name: (parallel, _batches(model, sizes), model, precision, clip)
            for name, (w, parallel, model, sizes, precision, clip) in CASES.items() if w == world}


@pytest.fixture(scope="module")
def job2(tmp_path_factory):
    return parallel_runs(2, _runs(2), tmp_path_factory.mktemp("tp-world2"))


@pytest.fixture(scope="module")
def job8(tmp_path_factory):
    return parallel_runs(8, _runs(8), tmp_path_factory.mktemp("tp-world8"))


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """The 4-rank job: (parity records: name -> per-rank records, checkpoint losses: name -> losses, its folder)."""
    folder = tmp_path_factory.mktemp("tp-world4")
    runs = _runs(4)
    spawn(_world4, ranks=range(4), world_size=4, master_addr="127.0.0.1", master_port=free_port(),
          args=(runs, CHECKPOINT_CASES, str(folder)), timeout_s=900)
    per_rank = [torch.load(folder / f"rank{r}.pt") for r in range(4)]
    return ({name: [records[name] for records in per_rank] for name in runs},
            json.loads((folder / "losses-4.json").read_text()), folder)


@pytest.fixture
def records(request):
    """name -> per-rank records of the job of the test's case (each job started once, by its first test)."""
    world = CASES[request.node.callspec.params["name"]][0]
    if world == 4:
        return request.getfixturevalue("jobs")[0]
    return request.getfixturevalue(f"job{world}")


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.bf16) if case[4] == "bf16" else name
                                  for name, case in CASES.items()])
def test_tp_matches_single_process(name, records):
    _, parallel, model, sizes, precision, clip = CASES[name]
    if precision == "bf16":
        assert clip is None  # the budget's gradient scales are those of unclipped gradients
        exact = reference_run(_batches(model, sizes), model, "fp32", terms=True)
        stages = bf16_stages(model, parallel)
        assert_bf16_parity(records[name], exact, forward=stages, lr=LR)
        assert_bf16_parity([reference_run(_batches(model, sizes), model, "bf16")], exact, forward=stages, lr=LR)
        return
    ref = reference_run(_batches(model, sizes), model, precision, clip)
    assert_parity(ref, records[name], rtol=RTOL, atol=ATOL)
    if clip is not None:
        assert min(ref["norms"]) > clip  # the clip acted on every step
        for record in records[name]:  # every rank: the unsplit model's norm, TP-replicated weights counted once
            assert record["norms"] == pytest.approx(ref["norms"], rel=1e-5)


@pytest.mark.bf16
@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case[4] == "bf16"])
def test_a_swapped_shard_is_outside_the_bf16_budget(name, records):
    """The budget still catches a wrong result: the two tp ranks' halves of the first MLP weight's step-0 gradient
    (column-parallel: rank 0 holds the first rows) swapped on every rank."""
    _, parallel, model, sizes, _, _ = CASES[name]
    exact = reference_run(_batches(model, sizes), model, "fp32", terms=True)
    wrong = []
    for record in records[name]:
        grads = dict(record["grads"][0])
        for key in [key for key in grads if key.endswith(("mlp.0.weight", "linear1.weight"))]:
            grads[key] = torch.cat(grads[key].chunk(2)[::-1])
        wrong.append({**record, "grads": [grads, *record["grads"][1:]]})
    with pytest.raises(AssertionError, match="outside the bf16 budget.*step 0 gradient of .*(mlp.0|linear1).weight"):
        assert_bf16_parity(wrong, exact, forward=bf16_stages(model, parallel), lr=LR)


@pytest.mark.parametrize("name", [name for name, (_, source) in CHECKPOINT_CASES.items() if source])
def test_resume_across_tp_degrees_continues_the_losses(name, jobs):
    _, losses, _ = jobs
    source = name.split("<-")[1]
    assert len(losses[name]) == len(losses[source]) - SAVE_AT
    torch.testing.assert_close(torch.tensor(losses[name]), torch.tensor(losses[source][SAVE_AT:]), rtol=RTOL, atol=ATOL)


def test_export_of_a_tp_checkpoint_is_the_unsplit_model(jobs, tmp_path):
    _, _, out = jobs
    for name in ("pp2xtp2", "dp2xtp2-fsdp"):
        weights = export_checkpoint(out / name, make_model(), tmp_path / f"{name}.pt")
        assert weights["1.self_attn.in_proj_weight"].shape == (96, 32)  # the fused q, k, v whole
        model = build_sequential(make_model(), seed=99).eval()  # other initial weights: all must be overwritten
        model.load_state_dict(torch.load(tmp_path / f"{name}.pt", weights_only=True))
        with torch.no_grad():
            outputs = model(make_batches([4])[0][0])
        torch.testing.assert_close(outputs, torch.load(out / f"outputs-{name}.pt"), rtol=RTOL, atol=ATOL)

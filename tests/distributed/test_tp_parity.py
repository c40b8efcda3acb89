"""Tensor parallelism is transparent: tp2, pp2 × tp2, dp2 × tp2 (FSDP2) and dp2 × pp2 × tp2 runs give the losses,
gradients and parameters of one process, and the global gradient-norm clip equals the unsplit model's.

One spawned job per world size runs every case (see harness.py). Tolerance in fp32: rtol 1e-5, atol 4e-5 (the
other parity tests': sums in another order, 3 SGD steps); bf16 autocast: rtol 2e-2, atol 2e-2 against the
single process under the same autocast (bf16 rounds at 8 bits of mantissa, in a different order per split).
"""

from __future__ import annotations

import pytest

from pipetrain.config import ParallelConfig, PipelineConfig
from tests.distributed.harness import assert_parity, make_batches, make_token_batches, parallel_runs, reference_run

RTOL, ATOL = 1e-5, 4e-5
BF16_RTOL, BF16_ATOL = 2e-2, 2e-2
CLIP = 0.5  # below the tiny models' gradient norms (about 1 to 3): every step is clipped
BATCHES = [8, 6, 3]  # a short last batch
DP_BATCHES = [16, 12, 6]


def _tp(tp: int = 2, pp: int = 1, schedule: str = "gpipe", dp: int = 1, chunks: int = 2) -> ParallelConfig:
    return ParallelConfig(tp=tp, dp=dp, dp_mode="fsdp", pipeline=PipelineConfig(pp=pp, schedule=schedule,
                                                                                 n_microbatches=chunks))


# name -> (world size, mesh, model, batch sizes, precision, clip)
CASES = {
    "tp2-classifier-clip": (2, _tp(), "classifier", BATCHES, "fp32", CLIP),
    "tp2-gpt": (2, _tp(), "gpt", BATCHES, "fp32", None),
    "pp2xtp2-gpipe-classifier": (4, _tp(pp=2), "classifier", BATCHES, "fp32", None),
    "pp2xtp2-1f1b-gpt-clip": (4, _tp(pp=2, schedule="1f1b"), "gpt", BATCHES, "fp32", CLIP),
    "pp2xtp2-interleaved-1f1b-gpt": (4, _tp(pp=2, schedule="interleaved-1f1b"), "gpt", BATCHES, "fp32", None),
    "dp2xtp2-fsdp-gpt-clip": (4, _tp(dp=2), "gpt", DP_BATCHES, "fp32", CLIP),
    "dp2xtp2-fsdp-classifier-bf16": (4, _tp(dp=2), "classifier", DP_BATCHES, "bf16", None),
    # the one 8-rank job (slow on 2 cores): two steps, the second a short batch
    "dp2xpp2xtp2-fsdp-1f1b-gpt-clip": (8, _tp(dp=2, pp=2, schedule="1f1b"), "gpt", [16, 12], "fp32", CLIP),
}


def _batches(model: str, sizes: list[int]):
    return make_batches(sizes) if model == "classifier" else make_token_batches(sizes)


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = {}
    for world in sorted({case[0] for case in CASES.values()}):
        runs = {name: (parallel, _batches(model, sizes), model, precision, clip)
                for name, (w, parallel, model, sizes, precision, clip) in CASES.items() if w == world}
        out.update(parallel_runs(world, runs, tmp_path_factory.mktemp(f"tp-world{world}")))
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_tp_matches_single_process(name, records):
    _, _, model, sizes, precision, clip = CASES[name]
    ref = reference_run(_batches(model, sizes), model, precision, clip)
    rtol, atol = (RTOL, ATOL) if precision == "fp32" else (BF16_RTOL, BF16_ATOL)
    assert_parity(ref, records[name], rtol=rtol, atol=atol)
    if clip is not None:
        assert min(ref["norms"]) > clip  # the clip acted on every step
        for record in records[name]:  # every rank: the unsplit model's norm, TP-replicated weights counted once
            assert record["norms"] == pytest.approx(ref["norms"], rel=1e-5)

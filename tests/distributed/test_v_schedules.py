"""The V-shaped schedules (`zbv`, `dualpipev`: rank r holds stages r and 2p - 1 - r) give the losses, gradients
and parameters of one process, and their forward-only passes its outputs.

Same method and tolerance as test_parity.py (rtol 1e-5, atol 4e-5, 3 SGD steps, then two evaluation batches).
The batches of 6 and 3 samples at 4 micro-batches run a remainder micro-batch, and every evaluation runs, in
`BreadthFirstV` (torch 2.13's own `eval()` of a V schedule fails); evaluation batches of 8, 8 and 3 samples
check that a forward-only pass leaves nothing pending for the next one of its shape. DDP is refused for these schedules (wrong gradients,
measured): data parallelism runs under FSDP2.
"""

from __future__ import annotations

import pytest

from pipetrain.config import ParallelConfig, PipelineConfig
from tests.distributed.harness import assert_parity, make_batches, parallel_runs, reference_run

RTOL, ATOL = 1e-5, 4e-5
PIPELINE_BATCHES = [8, 6, 3]
DP_BATCHES = [16, 12, 6]
MODEL = "classifier-eval-twice"


def _v(pp: int, schedule: str, policy: str = "never", *, dp: int = 1, chunks: int = 4) -> ParallelConfig:
    pipeline = PipelineConfig(pp=pp, schedule=schedule, n_microbatches=chunks, checkpoint=policy)
    return ParallelConfig(dp=dp, dp_mode="fsdp" if dp > 1 else "ddp", pipeline=pipeline)


CASES = {
    2: {
        "pp2-zbv": (_v(2, "zbv"), PIPELINE_BATCHES),
        "pp2-zbv-always": (_v(2, "zbv", "always"), PIPELINE_BATCHES),
        "pp2-dualpipev-except_last": (_v(2, "dualpipev", "except_last"), PIPELINE_BATCHES),
    },
    4: {
        "pp4-zbv": (_v(4, "zbv", "except_last"), PIPELINE_BATCHES),
        "pp4-dualpipev": (_v(4, "dualpipev", chunks=8), PIPELINE_BATCHES),  # at least 2 x pp micro-batches
        "dp2xpp2-zbv-fsdp": (_v(2, "zbv", dp=2), DP_BATCHES),
        "dp2xpp2-dualpipev-fsdp": (_v(2, "dualpipev", dp=2), DP_BATCHES),
    },
}


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = {}
    for world, cases in CASES.items():
        runs = {name: (parallel, make_batches(sizes), MODEL) for name, (parallel, sizes) in cases.items()}
        out.update(parallel_runs(world, runs, tmp_path_factory.mktemp(f"v{world}")))
    return out


@pytest.fixture(scope="module")
def references():
    return {tuple(sizes): reference_run(make_batches(sizes), MODEL) for sizes in (PIPELINE_BATCHES, DP_BATCHES)}


@pytest.mark.parametrize("name", [name for cases in CASES.values() for name in cases])
def test_v_schedule_matches_single_process(name, records, references):
    sizes = next(cases[name][1] for cases in CASES.values() if name in cases)
    assert_parity(references[tuple(sizes)], records[name], rtol=RTOL, atol=ATOL)

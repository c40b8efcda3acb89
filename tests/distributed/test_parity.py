"""Transparency: pipelined, data-parallel and hybrid runs give the losses, gradients and parameters of one process.

Each world size is one spawned gloo job running every case in turn (see harness.py); the tests then
compare each case with the single-process reference. Tolerance: float32 sums in another order, the
figures torch's own pipelining tests use (rtol 1e-5, atol 4e-5), over 3 SGD steps.
"""

from __future__ import annotations

import pytest

from pipetrain.config import ParallelConfig, PipelineConfig
from tests.distributed.harness import assert_parity, make_batches, make_token_batches, parallel_runs, reference_run

RTOL, ATOL = 1e-5, 4e-5
# 8, then a short batch that 4 chunks do not divide (4 x 1 + a remainder of 2), then one smaller than 4
PIPELINE_BATCHES = [8, 6, 3]
# per replica of dp=2: the same three shapes
DP_BATCHES = [16, 12, 6]
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
POLICIES = ("never", "except_last", "always")


def _pipe(pp: int, schedule: str, policy: str = "never", dp: int = 1, dp_mode: str = "ddp") -> ParallelConfig:
    pipeline = PipelineConfig(pp=pp, schedule=schedule, n_microbatches=4, checkpoint=policy)
    return ParallelConfig(dp=dp, dp_mode=dp_mode, pipeline=pipeline)


WORLD_CASES = {
    2: {
        **{f"pp2-{s}-{p}": (_pipe(2, s, p), PIPELINE_BATCHES) for s in SCHEDULES for p in POLICIES},
        "dp2-ddp": (_pipe(1, "gpipe", dp=2), DP_BATCHES),
        "dp2-fsdp": (_pipe(1, "gpipe", dp=2, dp_mode="fsdp"), DP_BATCHES),
    },
    4: {
        **{f"pp4-{s}": (_pipe(4, s, "except_last"), PIPELINE_BATCHES) for s in SCHEDULES},
        **{f"dp2xpp2-{s}-ddp": (_pipe(2, s, dp=2), DP_BATCHES) for s in ("gpipe", "1f1b", "interleaved-1f1b")},
        "dp2xpp2-interleaved-1f1b-fsdp": (_pipe(2, "interleaved-1f1b", dp=2, dp_mode="fsdp"), DP_BATCHES),
    },
}
# The causal decoder: (hidden states, boolean padding mask) cross every stage boundary; the loss is per token
# with padding ignored, over micro-batches holding unequal numbers of tokens (and replicas too, with dp=2).
GPT_CASES = {
    2: {f"gpt-pp2-{s}": (_pipe(2, s, "except_last"), PIPELINE_BATCHES) for s in ("gpipe", "1f1b", "interleaved-1f1b")},
    4: {
        **{f"gpt-pp4-{s}": (_pipe(4, s), PIPELINE_BATCHES) for s in ("gpipe", "1f1b", "interleaved-1f1b")},
        "gpt-dp2xpp2-1f1b-fsdp": (_pipe(2, "1f1b", dp=2, dp_mode="fsdp"), DP_BATCHES),
    },
}
ALL_CASES = {world: {**WORLD_CASES[world], **GPT_CASES[world]} for world in WORLD_CASES}


def _model(name: str) -> str:
    return "gpt" if name.startswith("gpt-") else "classifier"


def _batches(model: str, sizes: list[int]):
    return make_token_batches(sizes) if model == "gpt" else make_batches(sizes)


@pytest.fixture(scope="module")
def references():
    return {
        (model, tuple(sizes)): reference_run(_batches(model, sizes), model)
        for model in ("classifier", "gpt") for sizes in (PIPELINE_BATCHES, DP_BATCHES)
    }


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """name -> per-rank records, for every case of every world size (one job per world size)."""
    cases = {}
    for world, world_cases in ALL_CASES.items():
        batches = {name: (parallel, _batches(_model(name), sizes), _model(name))
                   for name, (parallel, sizes) in world_cases.items()}
        cases.update(parallel_runs(world, batches, tmp_path_factory.mktemp(f"world{world}")))
    return cases


@pytest.mark.parametrize("name", [name for world_cases in ALL_CASES.values() for name in world_cases])
def test_matches_single_process(name, records, references):
    sizes = next(c[1] for w in ALL_CASES.values() for n, c in w.items() if n == name)
    assert_parity(references[_model(name), tuple(sizes)], records[name], rtol=RTOL, atol=ATOL)

"""Transparency: a pipelined run gives the losses, gradients and parameters of the single-process run."""

from __future__ import annotations

import pytest

from pipetrain.config import ParallelConfig, PipelineConfig
from tests.dist.harness import assert_parity, make_batches, parallel_run, reference_run

# Batches of 8, then a short one that 4 chunks do not divide (4 x 1 + a remainder of 2),
# then one smaller than the chunk count (3 < 4).
BATCH_SIZES = [8, 6, 3]
# float32, a few reordered sums: the tolerance torch's own pipelining tests use
RTOL, ATOL = 1e-5, 4e-5


@pytest.fixture(scope="module")
def reference():
    return reference_run(make_batches(BATCH_SIZES))


CASES = [
    (pp, schedule, policy)
    for pp in (2, 4)
    for schedule in ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
    for policy in ("never", "except_last", "always")
    if pp == 2 or policy == "except_last"
]


@pytest.mark.parametrize(("pp", "schedule", "policy"), CASES)
def test_pipeline_matches_single_process(pp, schedule, policy, reference, tmp_path):
    parallel = ParallelConfig(pipeline=PipelineConfig(pp=pp, schedule=schedule, n_microbatches=4, checkpoint=policy))
    records = parallel_run(parallel, make_batches(BATCH_SIZES), tmp_path)
    assert_parity(reference, records, rtol=RTOL, atol=ATOL)

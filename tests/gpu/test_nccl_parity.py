"""The parity check on CUDA/NCCL: the same transparency test as tests/distributed, on real GPUs (skipped without them)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import assert_parity, make_batches, parallel_runs, reference_run
from tests.distributed.test_parity import DP_BATCHES, PIPELINE_BATCHES, _pipe

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

# TF32 matmuls and other kernels: looser than the CPU tolerance
RTOL, ATOL = 1e-3, 1e-4


def test_pipeline_and_data_parallel_on_two_gpus(tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = False
    cases = {
        "pp2-1f1b": (_pipe(2, "1f1b", "except_last"), make_batches(PIPELINE_BATCHES)),
        "dp2-fsdp": (_pipe(1, "gpipe", dp=2, dp_mode="fsdp"), make_batches(DP_BATCHES)),
    }
    records = parallel_runs(2, cases, tmp_path)
    assert_parity(reference_run(make_batches(PIPELINE_BATCHES)), records["pp2-1f1b"], rtol=RTOL, atol=ATOL)
    assert_parity(reference_run(make_batches(DP_BATCHES)), records["dp2-fsdp"], rtol=RTOL, atol=ATOL)

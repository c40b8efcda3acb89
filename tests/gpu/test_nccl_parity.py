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

# CUDA kernels (IEEE fp32: the cases run --precision fp32-strict, since plain fp32 multiplies in TF32 on CUDA) against
# the CPU reference: looser than the CPU tolerance
RTOL, ATOL = 1e-3, 1e-4
STRICT = "fp32-strict"


def test_pipeline_and_data_parallel_on_two_gpus(tmp_path):
    pipeline, dp = make_batches(PIPELINE_BATCHES), make_batches(DP_BATCHES)
    cases = {
        "pp2-1f1b": (_pipe(2, "1f1b", "except_last"), pipeline, "classifier", STRICT),
        "pp2-interleaved-1f1b": (_pipe(2, "interleaved-1f1b"), pipeline, "classifier", STRICT),
        "pp2-zero-bubble": (_pipe(2, "zero-bubble"), pipeline, "classifier", STRICT),
        "dp2-ddp": (_pipe(1, "gpipe", dp=2), dp, "classifier", STRICT),
        "dp2-fsdp": (_pipe(1, "gpipe", dp=2, dp_mode="fsdp"), dp, "classifier", STRICT),
    }
    records = parallel_runs(2, cases, tmp_path)
    for name in ("pp2-1f1b", "pp2-interleaved-1f1b", "pp2-zero-bubble"):
        assert_parity(reference_run(pipeline), records[name], rtol=RTOL, atol=ATOL)
    for name in ("dp2-ddp", "dp2-fsdp"):
        assert_parity(reference_run(dp), records[name], rtol=RTOL, atol=ATOL)

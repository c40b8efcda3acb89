"""The recipe's parity on CUDA/NCCL: clipped training at pp=2 and dp=2 FSDP equals one process (skipped without 2 GPUs)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_recipe_parity import CASES, _reference, _run, assert_recipe_parity

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

# other kernels than the CPU reference's (IEEE fp32: the ranks build their sessions with "fp32-strict"): looser than
# the CPU tolerance (as tests/gpu/test_nccl_parity.py)
RTOL, ATOL = 1e-3, 1e-4


def test_clipped_training_on_two_gpus(tmp_path):
    names = ("pp2-1f1b", "dp2-fsdp")
    records = _run(2, {name: CASES[2][name] for name in names}, tmp_path)
    for name in names:
        parallel, sizes = CASES[2][name]
        assert_recipe_parity(_reference(sizes), records[name], rtol=RTOL, atol=ATOL)

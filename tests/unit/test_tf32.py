"""fp32 on CUDA: TF32 matmuls by default, IEEE fp32 under "fp32-strict" (set through torch's backend flags, which
exist without a GPU), and the planner given the FLOP rate of the precision it plans for."""

from __future__ import annotations

from argparse import Namespace

import pytest
import torch

from pipetrain.cli.plan import calibration
from pipetrain.errors import ConfigError
from pipetrain.logs.mfu import peak_tflops
from pipetrain.pipeline.precision import set_fp32_matmuls
from pipetrain.plan.hardware import DEFAULT_NETWORK, Calibration, default_device, load_calibration, save_calibration


@pytest.fixture
def backend_flags():
    """Restore torch's fp32 matmul and convolution modes after the test."""
    saved = torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision
    yield
    torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = saved


def test_fp32_is_tf32_on_cuda_and_strict_is_ieee(backend_flags):
    assert set_fp32_matmuls("cuda:0", "fp32") == "tf32"
    assert torch.backends.cuda.matmul.fp32_precision == "tf32" and torch.backends.cudnn.conv.fp32_precision == "tf32"
    assert set_fp32_matmuls(torch.device("cuda", 0), "bf16") == "tf32"  # the fp32 parts of a bf16 run
    assert set_fp32_matmuls("cuda", "fp32-strict") == "ieee"
    assert torch.backends.cuda.matmul.fp32_precision == "ieee" and torch.backends.cudnn.conv.fp32_precision == "ieee"
    before = torch.backends.cuda.matmul.fp32_precision
    assert set_fp32_matmuls("cpu", "fp32") == "" and torch.backends.cuda.matmul.fp32_precision == before
    with pytest.raises(ConfigError, match="'fp16' is not supported"):
        set_fp32_matmuls("cuda", "fp16")


def test_mfu_peak_follows_the_precision():
    assert peak_tflops("NVIDIA H200", "fp32") == 495.0 and peak_tflops("NVIDIA H200", "fp32-strict") == 67.0


def _args(**extra) -> Namespace:
    return Namespace(**{"calibration": None, "calibrate": False, "precision": "fp32", "preset": None, **extra})


def test_the_planner_gets_the_rate_of_the_precision(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # no calibration file in ~/.cache
    rates = {p: calibration(_args(precision=p))[0].device.flops_per_s for p in ("fp32", "fp32-strict", "bf16")}
    assert rates == {"fp32": 150e12, "fp32-strict": 19.5e12, "bf16": 300e12}
    assert "at fp32-strict" in calibration(_args(precision="fp32-strict"))[1]
    path = tmp_path / "calibration.json"
    save_calibration(Calibration(device=default_device("bf16"), network=DEFAULT_NETWORK, backend="nccl",
                                 measured="now", precision="bf16"), path)
    assert load_calibration(path).precision == "bf16"
    assert calibration(_args(calibration=path, precision="bf16"))[0].device.flops_per_s == 300e12
    with pytest.raises(ConfigError, match="holds bf16 rates, this plan is for --precision fp32") as info:
        calibration(_args(calibration=path))
    assert "--precision bf16" in info.value.hint

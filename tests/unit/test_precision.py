"""Mixed precision of a stage module, without processes: the autocast wrapper and the precision names."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipetrain.errors import ConfigError
from pipetrain.pipeline.precision import AutocastStage, autocast, check_precision
from pipetrain.pipeline.recompute import RecomputeWrapper

pytestmark = pytest.mark.bf16


class TwoOutputs(nn.Module):
    """A block that returns a float tensor and an integer one (a mask) as a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.linear(x), (x > 0).long()


@pytest.mark.parametrize("name", ["fp8", "fp16", "float32", "BF16"])
def test_unsupported_precision_names_the_supported_ones(name):
    with pytest.raises(ConfigError, match=f"precision '{name}' is not supported") as err:
        check_precision(name)
    assert err.value.hint == "pass --precision fp32, fp32-strict or bf16 (default fp32)"


def test_fp16_error_says_why():
    with pytest.raises(ConfigError, match="loss scaling"):
        check_precision("fp16")


def test_stage_computes_in_bf16_and_hands_on_fp32():
    torch.manual_seed(0)
    block = TwoOutputs()
    x = torch.randn(4, 8)
    out, mask = AutocastStage(block, "bf16", "cpu")(x)
    assert out.dtype == torch.float32 and mask.dtype == torch.int64
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = block.linear(x)
    assert expected.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected.float(), rtol=0, atol=0)
    assert not torch.equal(out, block.linear(x)), "an fp32 forward would give other values"
    assert all(p.dtype == torch.float32 for p in block.parameters())


def test_gradients_reach_the_fp32_weights_and_recomputation_repeats_the_same_forward():
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    grads = []
    for policy in ("never", "always"):
        torch.manual_seed(0)
        block = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))
        stage = AutocastStage(RecomputeWrapper(block, policy), "bf16", "cpu")
        stage.module.start_step(1)
        stage(x).sum().backward()
        grads.append([p.grad for p in block.parameters()])
        assert all(g.dtype == torch.float32 for g in grads[-1])
    for never, always in zip(*grads):
        torch.testing.assert_close(always, never, rtol=0, atol=0)


def test_reference_autocast_context_is_off_for_fp32():
    with autocast("cpu", "fp32"):
        assert not torch.is_autocast_enabled("cpu")
    with autocast("cpu", "bf16"):
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16


def test_wrapping_an_fp32_stage_is_refused():
    with pytest.raises(ConfigError, match="fp32"):
        AutocastStage(nn.Linear(2, 2), "fp32", "cpu")

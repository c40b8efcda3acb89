"""The `Pipe` facade's deferred output and loss, without processes (tests/distributed/test_pipe_migration.py runs it)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipetrain.pipe import PipeLoss, PipeOutput


def test_a_loss_on_a_pipe_output_is_deferred_and_replays_the_recorded_shape_methods():
    inputs = torch.zeros(4, 3)
    output = PipeOutput(None, inputs, []).local_value().view(-1, 5)  # type: ignore[arg-type]
    targets = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
    loss = nn.CrossEntropyLoss(label_smoothing=0.1)(output, targets)
    assert isinstance(loss, PipeLoss) and loss.result is None and loss.output.inputs is inputs
    logits = torch.randn(4, 5, 2).transpose(1, 2)  # [batch, 2, 5], not contiguous, as a permuted stage output
    expected = F.cross_entropy(logits.contiguous().view(-1, 5), targets, label_smoothing=0.1)
    torch.testing.assert_close(loss.loss_fn(logits, targets), expected, rtol=0, atol=0)


def test_other_methods_before_the_loss_are_refused_by_name():
    with pytest.raises(AttributeError, match="not 'softmax'"):
        PipeOutput(None, torch.zeros(2, 2), []).softmax(-1)  # type: ignore[arg-type]


def test_a_loss_needs_one_target_tensor():
    with pytest.raises(TypeError, match="exactly one target tensor"):
        F.mse_loss(PipeOutput(None, torch.zeros(2), []), PipeOutput(None, torch.zeros(2), []))  # type: ignore[arg-type]


def test_other_ranks_children_are_freed():
    from pipetrain.pipe import free_other_stages

    children = [torch.nn.Linear(4, 4) for _ in range(4)]
    free_other_stages(children, [1, 2])
    assert [next(c.parameters()).device.type for c in children] == ["meta", "cpu", "cpu", "meta"]

"""The memoised meta shape pass (`ShapePass`): one pass per input layout and mode of one model, never another's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipetrain.blocks import ModuleListModel
from pipetrain.pipeline import shapes
from pipetrain.pipeline.shapes import ShapePass, boundary_tensors, meta_blocks
from pipetrain.workloads.lm.gpt import GPT_PRESETS, GPTModel


class Routed(nn.Module):
    """A block whose outputs depend on a switch its repr does not show (a router's auxiliary-loss setting)."""

    def __init__(self, aux: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.aux = aux

    def forward(self, x):
        y = self.linear(x)
        return (y, y.sum(-1)) if self.aux else y


def _routed(aux: bool) -> ModuleListModel:
    return ModuleListModel([nn.Linear(4, 4), Routed(aux)], torch.zeros(1, 4))


@pytest.fixture
def passes(monkeypatch):
    """The number of meta passes actually run (calls of `shapes.boundary_tensors`)."""
    count = [0]
    real = shapes.boundary_tensors

    def counted(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(shapes, "boundary_tensors", counted)
    return count


def _layout(boundaries):
    return [[(tuple(t.shape), t.dtype, t.device.type, t.requires_grad) for t in b] for b in boundaries]


def test_the_same_model_runs_each_layout_once(passes):
    shape_pass = ShapePass(_routed(False), [(0, 1), (1, 2)])
    x = torch.zeros(3, 4)
    first = shape_pass.boundaries(x, train=True)
    again = shape_pass.boundaries(x.clone(), train=True)  # another batch of the same layout
    assert passes[0] == 1 and shape_pass.passes == 1
    assert _layout(again) == _layout(first)
    assert again[1][0] is not first[1][0]  # fresh meta tensors: a caller's flags never reach the memo
    shape_pass.boundaries(x, train=False)  # evaluation is another pass
    shape_pass.boundaries(torch.zeros(2, 4), train=True)  # so is another micro-batch size
    shape_pass.check_outputs(torch.zeros(1, 4))  # the engine's check, an evaluation pass of one sample
    shape_pass.boundaries(torch.zeros(1, 4), train=False)  # ...which evaluating one sample then reuses
    assert passes[0] == 4 and shape_pass.passes == 4


def test_a_model_with_the_same_repr_is_not_served_from_another_models_memo(passes):
    plain, routed = _routed(False), _routed(True)
    assert repr(meta_blocks(plain)) == repr(meta_blocks(routed))
    x = torch.zeros(3, 4)
    assert len(ShapePass(plain, [(0, 1), (1, 2)]).boundaries(x, train=True)[-1]) == 1
    assert len(ShapePass(routed, [(0, 1), (1, 2)]).boundaries(x, train=True)[-1]) == 2  # logits and aux
    assert passes[0] == 2


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("sequence_shards", [1, 2])
def test_memoised_boundaries_equal_the_unmemoised_pass(train, sequence_shards):
    model = GPTModel(GPT_PRESETS["tiny"])
    bounds = [(0, 2), (2, 4), (4, 6)]
    shape_pass = ShapePass(model, bounds, sequence_shards=sequence_shards)
    tokens = torch.randint(1, 96, (3, 10))
    expected = _layout(boundary_tensors(meta_blocks(model), bounds, tokens, train=train,
                                        sequence_shards=sequence_shards))
    first = shape_pass.boundaries(tokens, train=train)
    assert _layout(first) == expected
    for tensor in first[1]:
        tensor.requires_grad_(False)  # what a caller may do to what it was given
    assert _layout(shape_pass.boundaries(tokens, train=train)) == expected
    assert shape_pass.passes == 1


def test_the_memo_keeps_at_most_its_capacity(passes):
    shape_pass = ShapePass(_routed(False), [(0, 1), (1, 2)], capacity=2)
    for size in (1, 2, 3, 1):  # 1 was dropped for 3, then rebuilt
        shape_pass.boundaries(torch.zeros(size, 4), train=True)
    assert passes[0] == 4 and len(shape_pass._memo) == 2
    shape_pass.boundaries(torch.zeros(3, 4), train=True)
    assert passes[0] == 4

"""The single-process reference keeps a model's declared ties: one parameter, whose gradient sums every use.

`pipetrain check` compares a layout with `build_sequential`'s model; a tied embedding and head (SmolLM2, GPT-2)
trained as two tensors there made `check` FAIL a correct tied pipeline (gradients 11x apart at step 2).
"""

from __future__ import annotations

import torch
from torch import nn

from pipetrain.blocks import ModuleListModel, build_sequential


class Tied(ModuleListModel):
    """An embedding (block 0) and an output matrix (block 2) of the same shape, declared one tensor."""

    def __init__(self) -> None:
        super().__init__([nn.Embedding(7, 4), nn.Tanh(), nn.Linear(4, 7, bias=False)], torch.zeros(2, 3, dtype=torch.long))

    def tied_parameters(self):
        return [((0, "weight"), (2, "weight"))]


def test_declared_ties_are_one_parameter_with_the_summed_gradient():
    model = Tied()
    net = build_sequential(model, seed=0)
    assert net[2].weight is net[0].weight
    names = [name for name, _ in net.named_parameters(remove_duplicate=False)]
    assert names == ["0.weight", "2.weight"] and len(list(net.parameters())) == 1

    tokens = torch.tensor([[1, 2, 3], [4, 5, 6]])
    net(tokens).logsumexp(-1).sum().backward()
    untied = build_sequential(ModuleListModel(model._modules, tokens), seed=0)  # the same weights, two tensors
    untied[2].weight.data.copy_(untied[0].weight.data)
    untied(tokens).logsumexp(-1).sum().backward()
    torch.testing.assert_close(net[0].weight.grad, untied[0].weight.grad + untied[2].weight.grad)


def test_a_model_without_ties_is_unchanged():
    plain = ModuleListModel([nn.Linear(3, 3), nn.Linear(3, 3)], torch.zeros(1, 3))
    net = build_sequential(plain, seed=0)
    assert net[0].weight is not net[1].weight

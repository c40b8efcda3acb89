"""The analytic Transformer costs: Korthikanti et al. 2022 activation memory, FLOPs, parameter counts."""

from __future__ import annotations

import pytest

from pipetrain.plan.model import transformer_activation_bytes, transformer_blocks

SHAPES = [(2048, 1, 12288, 96), (512, 4, 1024, 16), (64, 8, 64, 2), (256, 2, 4096, 16)]


@pytest.mark.parametrize("s,b,h,a", SHAPES)
def test_activation_memory_equals_the_published_formula(s, b, h, a):
    """Korthikanti et al. 2022, section 4.1 and table 2 (t = 1): 16-bit activations, f = 4h, dropout on."""
    assert transformer_activation_bytes(s, b, h, a) == s * b * h * (34 + 5 * a * s / h)
    assert transformer_activation_bytes(s, b, h, a, recompute="selective") == 34 * s * b * h
    assert transformer_activation_bytes(s, b, h, a, recompute="full") == 2 * s * b * h


def test_activation_memory_without_dropout_and_in_float32():
    s, b, h, a = 64, 1, 64, 2
    # no masks, the softmax output kept once; 4-byte elements
    assert transformer_activation_bytes(s, b, h, a, element=4, dropout=False) == (32 + 32) * s * b * h + 4 * a * s * s * b
    with pytest.raises(Exception):
        transformer_activation_bytes(s, b, h, a, recompute="some")


def test_parameter_counts_match_torch():
    import torch

    from pipetrain.workloads.classifier.model import PRESETS, TransformerClassifier

    c = PRESETS["cpu"]
    model = TransformerClassifier(c)
    blocks = transformer_blocks(vocab_size=c.vocab_size, seq_len=c.seq_len, emsize=c.emsize, nhead=c.nhead,
                                nhid=c.nhid, nlayers=c.nlayers, num_classes=c.num_classes, dropout=c.dropout)
    with torch.device("meta"):
        counts = [sum(p.numel() for p in model.build_block(i).parameters()) for i in range(model.num_blocks)]
    assert [b.params for b in blocks] == counts


def test_layer_flops_follow_narayanan():
    s, h = 128, 256
    layer = transformer_blocks(vocab_size=10, seq_len=s, emsize=h, nhead=4, nhid=4 * h, nlayers=1,
                               num_classes=2, dropout=0.0)[1]
    assert layer.forward_flops == 24 * s * h * h + 4 * s * s * h  # per sample (Narayanan et al. 2021, eq. 3 / 3)


def test_tensor_split_parameters_are_the_torch_layers_matrices():
    """What the planner divides by tp: the attention's in/out projection weights, the MLP's weights, the
    column-parallel biases (in_proj, linear1); the row-parallel biases and the norms stay whole."""
    import torch
    from torch import nn

    layer_cost = transformer_blocks(vocab_size=10, seq_len=8, emsize=32, nhead=2, nhid=64, nlayers=1,
                                    num_classes=2, dropout=0.1)[1]
    with torch.device("meta"):
        layer = nn.TransformerEncoderLayer(32, 2, 64)
    split = ("self_attn.in_proj_weight", "self_attn.in_proj_bias", "self_attn.out_proj.weight", "linear1.weight",
             "linear1.bias", "linear2.weight")
    assert sum(p.numel() for n, p in layer.named_parameters() if n in split) == layer_cost.tensor.params
    assert sum(p.numel() for p in layer.parameters()) == layer_cost.params

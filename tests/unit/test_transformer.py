"""Tests of the reference Transformer classifier as a block model."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from pipetrain.blocks import BlockModel, build_blocks, build_sequential
from pipetrain.errors import ConfigError
from pipetrain.workloads.classifier.model import PRESETS, TransformerClassifier, TransformerConfig

TINY = PRESETS["tiny"]


def tokens(config: TransformerConfig, batch: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch, config.seq_len), generator=g)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"emsize": 30, "nhead": 4}, "not divisible by nhead"),
        ({"dropout": 1.0}, "dropout"),
        ({"dropout": -0.1}, "dropout"),
        ({"nlayers": 0}, "nlayers"),
        ({"seq_len": 0}, "seq_len"),
        ({"vocab_size": 1}, "vocab_size"),
        ({"num_classes": 1}, "num_classes"),
        ({"nhid": 2.5}, "nhid"),
    ],
)
def test_config_validation(change, message):
    with pytest.raises(ConfigError, match=message) as info:
        dataclasses.replace(TINY, **change)
    assert info.value.hint


def test_config_is_frozen_and_keyword_only():
    with pytest.raises(dataclasses.FrozenInstanceError):
        TINY.emsize = 8  # type: ignore[misc]
    with pytest.raises(TypeError):
        TransformerConfig(1000, 32, 32, 2, 64, 4, 0.0)  # type: ignore[misc]


def test_presets():
    assert set(PRESETS) == {"tiny", "cpu", "gpu"}
    gpu = PRESETS["gpu"]
    assert (gpu.emsize, gpu.nhid, gpu.nhead, gpu.nlayers, gpu.dropout) == (4096, 4096, 16, 12, 0.2)
    for config in PRESETS.values():
        assert TransformerClassifier(config).num_blocks == config.nlayers + 2


def test_is_a_block_model_with_the_documented_blocks():
    model = TransformerClassifier(TINY)
    assert isinstance(model, BlockModel)
    assert model.num_blocks == TINY.nlayers + 2
    assert isinstance(model.build_block(1), nn.TransformerEncoderLayer)
    assert model.build_block(1).self_attn.batch_first
    example = model.example_input(3)
    assert example.shape == (3, TINY.seq_len) and example.dtype == torch.long and not example.any()
    for bad in (-1, model.num_blocks):
        with pytest.raises(IndexError):
            model.build_block(bad)


def test_shapes_through_the_blocks():
    model = TransformerClassifier(TINY)
    x = tokens(TINY, 5)
    hidden = model.build_block(0)(x)
    assert hidden.shape == (5, TINY.seq_len, TINY.emsize)
    hidden = model.build_block(1)(hidden)
    assert hidden.shape == (5, TINY.seq_len, TINY.emsize)
    assert model.build_block(model.num_blocks - 1)(hidden).shape == (5, TINY.num_classes)


@pytest.mark.parametrize("train", [True, False])
def test_blocks_one_by_one_equal_sequential(train):
    model = TransformerClassifier(TINY)
    sequential = build_sequential(model, seed=3).train(train)
    separate = [block.train(train) for block in build_blocks(model, range(model.num_blocks), seed=3)]
    x = tokens(TINY, 4)
    with torch.no_grad():
        expected = sequential(x)
        hidden = x
        for block in separate:
            hidden = block(hidden)
    torch.testing.assert_close(hidden, expected, rtol=0, atol=0)


def test_eval_fast_path_matches_training_path():
    # Without dropout, eval under no_grad (the encoder's fused fast path) and train mode must agree.
    model = build_sequential(TransformerClassifier(TINY), seed=0)
    x = tokens(TINY, 6)
    train_out = model.train()(x)
    with torch.no_grad():
        eval_out = model.eval()(x)
    assert train_out.requires_grad and not eval_out.requires_grad
    torch.testing.assert_close(eval_out, train_out.detach(), rtol=1e-5, atol=1e-5)


def test_dropout_only_in_training():
    config = dataclasses.replace(TINY, dropout=0.3)
    model = build_sequential(TransformerClassifier(config), seed=0)
    x = tokens(config, 4)
    assert not torch.equal(model.train()(x), model(x))
    with torch.no_grad():
        assert torch.equal(model.eval()(x), model(x))


def test_backward_reaches_every_parameter():
    model = build_sequential(TransformerClassifier(TINY), seed=0)
    loss = nn.functional.cross_entropy(model(tokens(TINY, 4)), torch.tensor([0, 1, 1, 0]))
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


def test_same_seed_same_weights_different_seed_different():
    model = TransformerClassifier(TINY)
    a, b, c = (build_sequential(model, seed=s) for s in (1, 1, 2))
    x = tokens(TINY, 2)
    assert torch.equal(a(x), b(x))
    assert not torch.equal(a(x), c(x))


def test_builds_on_meta_device_without_storage():
    model = TransformerClassifier(PRESETS["gpu"])
    with torch.device("meta"):
        blocks = [model.build_block(i) for i in range(model.num_blocks)]
    tensors = [t for block in blocks for t in [*block.parameters(), *block.buffers()]]
    assert tensors and all(t.is_meta for t in tensors)
    with torch.device("meta"):
        out = blocks[0](torch.zeros(2, PRESETS["gpu"].seq_len, dtype=torch.long))
    assert out.shape == (2, PRESETS["gpu"].seq_len, PRESETS["gpu"].emsize)


def test_positions_are_a_constant_not_state():
    block = TransformerClassifier(TINY).build_block(0)
    assert "positions" not in block.state_dict()
    assert block.positions.shape == (TINY.seq_len, TINY.emsize)
    assert torch.equal(block.positions, TransformerClassifier(TINY).build_block(0).positions)


def test_too_long_input_is_rejected():
    block = TransformerClassifier(TINY).build_block(0)
    with pytest.raises(ConfigError, match="seq_len=32"):
        block(torch.zeros(1, TINY.seq_len + 1, dtype=torch.long))

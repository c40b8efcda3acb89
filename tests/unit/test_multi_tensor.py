"""Several tensors between blocks: tuple passing, meta shape inference, gradient flags, refused outputs."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from pipetrain.blocks import BlockSequential, ModuleListModel, build_sequential
from pipetrain.errors import ConfigError
from pipetrain.pipeline.shapes import boundary_tensors, check_model_outputs, meta_blocks, signature
from pipetrain.pipeline.stages import ScheduleCache
from pipetrain.workloads.lm.gpt import GPT_PRESETS, GPTModel


class Split(nn.Module):
    def forward(self, x):
        return x * 2, (x > 0), torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)


class Join(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x, positive, positions):
        return self.linear(x * positive + positions)


class Returns(nn.Module):
    def __init__(self, value):
        super().__init__()
        self.value = value

    def forward(self, x):
        return self.value(x)


def test_block_sequential_passes_tuples_positionally():
    torch.manual_seed(0)
    split, join = Split(), Join()
    x = torch.randn(3, 4)
    out = BlockSequential(split, join)(x)
    torch.testing.assert_close(out, join(*split(x)))


def test_block_sequential_equals_sequential_on_one_tensor():
    layers = [nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)]
    x = torch.randn(5, 4)
    torch.testing.assert_close(BlockSequential(*layers)(x), nn.Sequential(*layers)(x))
    assert [n for n, _ in BlockSequential(*layers).named_parameters()] == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_boundaries_of_a_decoder_carry_hidden_states_and_a_mask():
    model = GPTModel(GPT_PRESETS["tiny"])
    tokens = torch.randint(1, 96, (3, 10))
    train = boundary_tensors(meta_blocks(model), [(0, 2), (2, 4), (4, 6)], tokens, train=True)
    assert [[(tuple(t.shape), t.dtype, t.requires_grad) for t in b] for b in train] == [
        [((3, 10), torch.long, False)],
        [((3, 10, 32), torch.float32, True), ((3, 10), torch.bool, False)],
        [((3, 10, 32), torch.float32, True), ((3, 10), torch.bool, False)],
        [((3, 10, 96), torch.float32, True)],
    ]
    assert all(t.device.type == "meta" for b in train for t in b)
    evaluation = boundary_tensors(meta_blocks(model), [(0, 3), (3, 6)], tokens, train=False)
    assert not any(t.requires_grad for b in evaluation for t in b)


def test_a_float_tensor_without_parameters_behind_it_crosses_without_gradient():
    # a position table made from the input alone: no parameter, so no gradient is sent back for it
    model = ModuleListModel([Split(), Join()], example_input=torch.zeros(1, 4))
    bounds = boundary_tensors(meta_blocks(model), [(0, 1), (1, 2)], torch.zeros(2, 4), train=True)
    assert [t.requires_grad for t in bounds[1]] == [False, False, False]
    assert signature(bounds[1]) == (((2, 4), torch.float32), ((2, 4), torch.bool), ((2, 4), torch.int64))


def test_module_list_model_repeats_each_example_input():
    model = ModuleListModel([Split(), Join()], example_input=(torch.zeros(1, 4), torch.ones(1, 4, dtype=torch.bool)))
    x, mask = model.example_input(3)
    assert x.shape == (3, 4) and mask.shape == (3, 4) and mask.dtype == torch.bool


@pytest.mark.parametrize(
    "value, what",
    [(lambda x: 0.5, "a float (0.5)"), (lambda x: (x, None), "a NoneType (None)"),
     (lambda x: {"h": x}, "a dict"), (lambda x: (), "an empty tuple")],
)
def test_an_output_that_cannot_cross_a_stage_is_refused_naming_the_block(value, what):
    model = ModuleListModel([nn.Linear(4, 4), Returns(value), nn.Identity()], example_input=torch.zeros(1, 4))
    with pytest.raises(ConfigError) as err:
        boundary_tensors(meta_blocks(model), [(0, 2), (2, 3)], torch.zeros(2, 4), train=True)
    assert err.value.message.startswith(f"block 1 (Returns) returned {what}")
    assert err.value.message.endswith("which cannot cross a pipeline stage")
    assert "tensor or a tuple of tensors" in err.value.hint


def test_the_last_block_must_return_the_one_tensor_the_loss_reads():
    model = ModuleListModel([nn.Linear(4, 4), Split()], example_input=torch.zeros(1, 4))
    with pytest.raises(ConfigError, match=r"the last block \(1, Split\) returns 3 tensors, but the loss reads one"):
        check_model_outputs(meta_blocks(model), [(0, 1), (1, 2)], model.example_input(1))
    check_model_outputs(meta_blocks(GPTModel(GPT_PRESETS["tiny"])), [(0, 3), (3, 6)], torch.zeros(1, 4, dtype=torch.long))


def test_reference_model_takes_a_tuple_input():
    model = ModuleListModel([Join()], example_input=(torch.zeros(1, 4), torch.ones(1, 4), torch.zeros(1, 4)))
    out = build_sequential(model, seed=0)(*model.example_input(2))
    assert out.shape == (2, 4)


class _Entry:
    pass


def test_schedule_cache_keeps_the_most_recently_used_and_frees_the_rest():
    cache = ScheduleCache(2)
    a, fresh = cache.get("a", _Entry)
    assert fresh
    dropped = weakref.ref(cache.get("b", _Entry)[0])
    assert cache.get("a", _Entry) == (a, False)  # a is now the most recent
    cache.get("c", _Entry)  # evicts b
    gc.collect()
    assert dropped() is None and len(cache) == 2 and cache.evictions == 1
    assert "a" in cache and "c" in cache and "b" not in cache
    assert cache.get("b", _Entry)[1]  # rebuilt when needed again


def test_schedule_cache_refuses_no_room():
    with pytest.raises(ConfigError, match="room for 1 shape or more, got 0"):
        ScheduleCache(0)

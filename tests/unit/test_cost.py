"""Tests of per-block parameter costs (measured on the meta device) and of balance resolution."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipetrain.blocks import ModuleListModel
from pipetrain.config import PipelineConfig
from pipetrain.errors import ConfigError
from pipetrain.partition import parameter_costs, resolve_balance
from pipetrain.workloads.classifier.model import PRESETS, TransformerClassifier


def small_model() -> ModuleListModel:
    modules = [nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)]
    return ModuleListModel(modules, torch.zeros(1, 4))


def test_parameter_costs_of_a_module_list():
    assert parameter_costs(small_model()) == [40, 0, 72, 0, 18]


def test_shared_parameters_counted_once():
    linear = nn.Linear(3, 3)
    shared = nn.Sequential(linear, nn.ReLU(), linear)
    assert parameter_costs(ModuleListModel([shared], torch.zeros(1, 3))) == [12]


def test_parameter_costs_match_real_blocks():
    model = TransformerClassifier(PRESETS["tiny"])
    real = [sum(p.numel() for p in model.build_block(i).parameters()) for i in range(model.num_blocks)]
    assert parameter_costs(model) == real


def test_parameter_costs_use_no_memory():
    # ~1.3e9 parameters: only possible quickly because the blocks are built on the meta device.
    config = PRESETS["gpu"]
    costs = parameter_costs(TransformerClassifier(config))
    assert len(costs) == config.nlayers + 2
    assert costs[0] == config.vocab_size * config.emsize
    assert costs[-1] == 2 * config.emsize + config.emsize * config.num_classes + config.num_classes  # norm + linear
    assert len(set(costs[1:-1])) == 1


def test_resolve_explicit_balance():
    config = PipelineConfig(pp=2, balance=(4, 1))
    assert resolve_balance(small_model(), config) == [4, 1]


def test_resolve_uniform():
    config = PipelineConfig(pp=2, partition="uniform")
    assert resolve_balance(small_model(), config) == [3, 2]


def test_resolve_by_parameters():
    # costs [40, 0, 72, 0, 18]: the 72 is the bottleneck, the first part takes the 40 and a 0.
    assert resolve_balance(small_model(), PipelineConfig(pp=2, partition="parameters")) == [2, 3]
    assert resolve_balance(small_model(), PipelineConfig(pp=3, partition="parameters")) == [2, 2, 1]


def test_resolve_counts_virtual_stages():
    config = PipelineConfig(pp=2, schedule="interleaved-1f1b", n_microbatches=2, partition="uniform")
    assert resolve_balance(small_model(), config) == [2, 1, 1, 1]


def test_resolve_transformer_by_parameters_isolates_the_embedding():
    model = TransformerClassifier(PRESETS["tiny"])
    balance = resolve_balance(model, PipelineConfig(pp=2, partition="parameters"))
    assert balance[0] == 1 and sum(balance) == model.num_blocks


def test_resolve_rejects_too_few_blocks():
    with pytest.raises(ConfigError, match="needs 6 blocks"):
        resolve_balance(small_model(), PipelineConfig(pp=6))


def test_resolve_rejects_balance_of_wrong_total():
    with pytest.raises(ConfigError, match="sums to 4"):
        resolve_balance(small_model(), PipelineConfig(pp=2, balance=(3, 1)))

"""The workload registry: names, presets, errors, and the trainer asking it (no process group)."""

from __future__ import annotations

import pytest
import torch.nn.functional as F

from pipetrain.errors import ConfigError
from pipetrain.train.loop import TrainConfig, load_data
from pipetrain.workloads import registry
from pipetrain.workloads.classifier.workload import ClassifierWorkload
from pipetrain.workloads.registry import get_workload, register, workload_names
from pipetrain.workloads.classifier.model import TransformerClassifier


def test_classifier_is_the_default_workload():
    config = TrainConfig(preset="tiny", data="synthetic", train_samples=16, test_samples=8, batch_size=8)
    assert config.workload == "classifier"
    assert isinstance(config.task(), ClassifierWorkload)
    assert isinstance(config.model(), TransformerClassifier)
    train, test = load_data(config)
    assert (len(train), len(test)) == (16, 8) and train.synthetic
    assert config.task().loss() is F.cross_entropy


def test_unknown_workload_lists_the_known_ones():
    with pytest.raises(ConfigError, match="unknown workload 'nope'") as err:
        get_workload("nope")
    assert "classifier" in err.value.hint


def test_unknown_preset_names_the_workload_and_its_presets():
    with pytest.raises(ConfigError, match="unknown preset 'huge' for workload 'classifier'") as err:
        TrainConfig(preset="huge")
    assert err.value.hint == "choose one of: tiny, cpu, gpu"


def test_register_adds_a_workload_and_refuses_a_taken_name(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTERED", {})
    register("mine", ClassifierWorkload)
    assert workload_names()[-1] == "mine"
    assert isinstance(get_workload("mine"), ClassifierWorkload)
    with pytest.raises(ConfigError, match="'classifier' is already registered"):
        register("classifier", ClassifierWorkload)


def test_a_bench_cell_names_its_workload_before_the_preset():
    from pipetrain.bench.cell import cell_workload
    from pipetrain.bench.grid import Cell, parse_axis
    from pipetrain.workloads.lm.gpt import GPTModel

    workload, preset = cell_workload(Cell(batch_size=8, preset="lm:tiny"))
    assert (workload.name, preset) == ("lm", "tiny") and isinstance(workload.model(preset), GPTModel)
    assert cell_workload(Cell(batch_size=8, preset="tiny"))[0].name == "classifier"
    assert parse_axis("preset=tiny,lm:cpu") == ("preset", ["tiny", "lm:cpu"])
    with pytest.raises(ConfigError, match="unknown preset 'huge' for workload 'lm'"):
        cell_workload(Cell(batch_size=8, preset="lm:huge"))

"""Measuring per-block profiles, balancing stages by measured time/memory, and the CLI's bad-input messages."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from pipetrain.blocks import ModuleListModel
from pipetrain.cli import bench as bench_cli
from pipetrain.cli import main as cli_main
from pipetrain.cli import train_run as train_cli
from pipetrain.config import PipelineConfig
from pipetrain.errors import ConfigError
from pipetrain.partition import cost_balance, resolve_balance
from pipetrain.partition.measure import model_fingerprint, profile_model
from pipetrain.partition.profile import BlockProfile, ModelProfile, load_profile, save_profile
from pipetrain.partition.stagecost import STATE_FACTOR, balance_by_cost, in_flight, stage_costs
from pipetrain.workloads.classifier.model import PRESETS, TransformerClassifier


def mlp(widths: list[int]) -> ModuleListModel:
    layers = [nn.Sequential(nn.Linear(a, b), nn.ReLU()) for a, b in zip(widths, widths[1:])]
    return ModuleListModel(layers, torch.zeros(2, widths[0]))


def test_profile_counts_parameters_outputs_and_saved_activations():
    torch.manual_seed(0)
    model = mlp([16, 32, 8])
    profile = profile_model(model, 4, repeats=2)
    first, second = profile.blocks
    assert (first.name, first.index, second.index) == ("Sequential", 0, 1)
    assert first.param_bytes == (16 * 32 + 32) * 4 and second.param_bytes == (32 * 8 + 8) * 4
    assert first.output_bytes == 4 * 32 * 4 and second.output_bytes == 4 * 8 * 4
    # Linear saves its input (the weight is a parameter, not counted); ReLU saves its output
    assert first.activation_bytes == 4 * 16 * 4 + 4 * 32 * 4
    assert all(b.forward_s > 0 and b.backward_s > 0 for b in profile.blocks)
    assert profile.micro_batch_size == 4 and profile.repeats == 2 and profile.dtype == "float32"
    assert profile.fingerprint == model_fingerprint(model)


def test_profile_of_the_reference_transformer_round_trips(tmp_path):
    model = TransformerClassifier(PRESETS["tiny"])
    profile = profile_model(model, 2, repeats=1, name="classifier:tiny")
    assert [b.name for b in profile.blocks] == ["EmbeddingBlock"] + ["TransformerEncoderLayer"] * 4 + ["HeadBlock"]
    assert profile.blocks[0].activation_bytes == 0 or profile.blocks[0].activation_bytes < profile.blocks[1].activation_bytes
    save_profile(profile, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == profile


def test_fingerprint_tells_models_apart():
    assert model_fingerprint(mlp([4, 8, 2])) == model_fingerprint(mlp([4, 8, 2]))
    assert model_fingerprint(mlp([4, 8, 2])) != model_fingerprint(mlp([4, 9, 2]))


def fake_profile(times: list[float], params: list[int], acts: list[int], mbs: int = 4) -> ModelProfile:
    blocks = tuple(BlockProfile(index=i, name="B", forward_s=t / 3, backward_s=2 * t / 3, param_bytes=p,
                                activation_bytes=a, output_bytes=1) for i, (t, p, a) in enumerate(zip(times, params, acts)))
    return ModelProfile(model="m", fingerprint="f", micro_batch_size=mbs, device="cpu", dtype="float32",
                        repeats=1, blocks=blocks)


def test_in_flight_micro_batches_per_schedule():
    assert [in_flight("gpipe", 4, 8, s) for s in range(4)] == [8] * 4
    assert [in_flight("1f1b", 4, 8, s) for s in range(4)] == [4, 3, 2, 1]
    assert in_flight("1f1b", 4, 2, 0) == 2
    with pytest.raises(ConfigError, match="one stage per rank"):
        in_flight("interleaved-1f1b", 2, 4, 0)


def test_time_memory_and_capped_balances():
    profile = fake_profile([8, 1, 1, 1, 1, 8], [0, 0, 0, 0, 0, 100], [10, 10, 10, 10, 10, 10])
    by_time = balance_by_cost(profile, method="time", stages=2, schedule="gpipe", chunks=2)
    assert by_time.balance == (3, 3)
    assert [s.time_s for s in by_time.stages] == pytest.approx([10, 10])
    assert by_time.stages[1].memory_bytes == STATE_FACTOR * 100 + 2 * 30
    by_memory = balance_by_cost(profile, method="memory", stages=2, schedule="gpipe", chunks=2)
    assert by_memory.balance == (5, 1)  # the head's 400 bytes of state outweigh 5 blocks' activations
    # per-block memory at 2 micro-batches in flight: [20, 20, 20, 20, 20, 420] bytes
    capped = balance_by_cost(profile, method="time", stages=2, schedule="gpipe", chunks=2, mem_cap_mb=450 / 2**20)
    assert capped.balance == (4, 2) and [s.memory_bytes for s in capped.stages] == [80, 440]
    with pytest.raises(ConfigError, match="smallest cap that fits") as info:
        balance_by_cost(profile, method="time", stages=2, schedule="gpipe", chunks=2, mem_cap_mb=419 / 2**20)
    assert info.value.smallest == 420
    assert "stage 1" in "\n".join(by_time.lines())
    assert stage_costs(profile, [1, 5], schedule="1f1b", chunks=4)[0].memory_bytes == 2 * 10


def test_cost_partition_needs_costs_and_checks_the_profile():
    model = mlp([8, 8, 8, 8])
    config = PipelineConfig(pp=2, partition="time")
    with pytest.raises(ConfigError, match="measured costs"):
        resolve_balance(model, config)
    profile = profile_model(model, 2, repeats=1)
    balanced, choice = cost_balance(model, config, micro_batch_size=2, profile=profile)
    assert balanced.balance == choice.balance and sum(choice.balance) == 3
    with pytest.raises(ConfigError, match="micro-batch size 2, this run uses 4"):
        cost_balance(model, config, micro_batch_size=4, profile=profile)
    with pytest.raises(ConfigError, match="another model"):
        cost_balance(mlp([8, 16, 8, 8]), config, micro_batch_size=2, profile=profile)


TRAIN = ["train", "--preset", "tiny", "--data", "synthetic", "--train-samples", "64", "--test-samples", "32",
         "--epochs", "1", "--no-progress", "--batch-size", "8", "--chunks", "2"]


@pytest.fixture
def cli(monkeypatch, capsys):
    for name in list(os.environ):
        if name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") or name.startswith("SLURM_"):
            monkeypatch.delenv(name)

    def no_ranks(*args, **kwargs):
        raise AssertionError("the CLI started ranks instead of rejecting its input")

    monkeypatch.setattr(train_cli, "spawn", no_ranks)
    monkeypatch.setattr(bench_cli, "run_grid", no_ranks)

    def run(argv: list[str]) -> tuple[int, str]:
        code = cli_main.main(argv)
        return code, capsys.readouterr().err

    return run


def test_cli_bad_profile_and_cap_inputs(cli, tmp_path):
    other = tmp_path / "other.json"
    assert cli(["profile", "--preset", "tiny", "--micro-batch-size", "2", "--repeats", "1", "-o", str(other)])[0] == 0
    code, err = cli([*TRAIN, "--partition", "time", "--profile", str(other)])
    assert code == 2 and "micro-batch size 2, this run uses 4" in err and err.count("error") == 1
    code, err = cli([*TRAIN, "--preset", "cpu", "--partition", "time", "--profile", str(other)])
    assert code == 2 and "another model" in err and str(other) in err
    code, err = cli([*TRAIN, "--mem-cap", "0.01"])
    assert code == 2 and "smallest cap that fits is" in err and "--mem-cap" in err
    code, err = cli([*TRAIN, "--profile", str(other)])
    assert code == 2 and "--partition time" in err
    code, err = cli([*TRAIN, "--partition", "memory", "--mem-cap", "100"])
    assert code == 2 and "needs --partition time" in err
    (tmp_path / "bad.json").write_text("[]")
    code, err = cli([*TRAIN, "--partition", "time", "--profile", str(tmp_path / "bad.json")])
    assert code == 2 and "not a valid" in err


def test_cli_bad_trace_inputs(cli, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, err = cli([*TRAIN, "--trace", str(blocker / "trace")])
    assert code == 2 and "cannot write the trace folder" in err and err.count("error") == 1
    code, err = cli(["bench", "--quick", "--out", str(tmp_path / "out"), "--trace", str(blocker / "trace")])
    assert code == 2 and "cannot write the trace folder" in err and err.count("error") == 1
    code, err = cli([*TRAIN, "--trace", str(tmp_path / "t"), "--trace-steps", "0"])
    assert code == 2 and "0 traced step(s)" in err
    code, err = cli([*TRAIN, "--trace", str(tmp_path / "t"), "--max-steps", "2"])
    assert code == 2 and "records no step" in err
    # 64 samples at batch 8: 8 steps, all within 10 warm-up steps
    code, err = cli([*TRAIN, "--trace", str(tmp_path / "t"), "--trace-warmup", "10"])
    assert code == 2 and "the run has 8 step(s)" in err

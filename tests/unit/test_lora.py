"""LoRA without a process group: the planner's memory of frozen parameters, the settings, the TP split of the
adapters as plain data, the blocks PEFT's layers are injected into, and every bad LoRA input (one message each,
CLI exit 2)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from pipetrain.checkpoint.folders import CheckpointMeta, write_meta
from pipetrain.cli import main as cli_main
from pipetrain.compat.tensor_styles import Conv1DParallel, FusedColwiseParallel
from pipetrain.errors import ConfigError
from pipetrain.lora import LoraSettings, lora_tp_plan
from pipetrain.plan.model import BlockCost
from pipetrain.plan.predict import Layout, optimizer_s, static_bytes
from pipetrain.plan.hardware import Device

BLOCK = BlockCost(name="layer", params=1000, param_bytes=4000.0, activation_bytes=0.0, output_bytes=0.0, tensors=4)
#: the same block with all but 10 parameters frozen (a LoRA run: base frozen, adapters trained)
FROZEN = dataclasses.replace(BLOCK, frozen_params=990)


@pytest.mark.parametrize(("dp", "mode", "precision", "full", "lora"), [
    (1, "ddp", "fp32", 4 * 4000, 4000 + 3 * 40),  # weights, grads, 2 moments | weights + the adapters' 3 copies
    (2, "ddp", "fp32", 5 * 4000, 4000 + 4 * 40),  # + DDP's bucket (the adapters' only)
    (2, "fsdp", "fp32", 2 * 4000 + 4 * 4000 / 2, 4000 + 40 + (4000 + 3 * 40) / 2),
    (2, "fsdp", "bf16", 2 * 1000 + 4 * 1000 + 16 * 1000 / 2, 2 * 1000 + 4 * 10 + (4 * 1000 + 12 * 10) / 2),
])
def test_the_planner_gives_frozen_parameters_no_gradient_nor_optimizer_state(dp, mode, precision, full, lora):
    layout = Layout(dp=dp, pp=1, batch=8, chunks=1, dp_mode=mode, precision=precision)
    assert static_bytes([BLOCK], layout) == pytest.approx(full)  # unchanged without frozen parameters
    assert static_bytes([FROZEN], layout) == pytest.approx(lora)
    assert static_bytes([FROZEN], layout) < 0.5 * static_bytes([BLOCK], layout)


def test_the_optimizer_step_is_priced_over_the_trained_parameters_only():
    device = Device(name="cpu", flops_per_s=1e9, bytes_per_s=1e9, kernel_overhead_s=0.0, action_overhead_s=0.0,
                    optimizer_s_per_param=1e-6, memory_bytes=1e9)
    assert optimizer_s([FROZEN], device) == pytest.approx(optimizer_s([BLOCK], device) / 100)
    assert FROZEN.trained_share == pytest.approx(0.01) and BLOCK.trained_share == 1.0


def test_settings_default_alpha_and_refuse_bad_values():
    settings = LoraSettings(rank=4, targets="q_proj, v_proj")
    assert settings.targets == ("q_proj", "v_proj") and settings.scale_alpha == 8.0
    config = settings.peft_config(settings.targets)
    assert (config.r, config.lora_alpha, config.lora_dropout) == (4, 8, 0.0)
    for bad, match in ((dict(rank=0), "--lora-rank must be 1 or more, got 0"),
                       (dict(rank=2, alpha=-1.0), "--lora-alpha must be positive"),
                       (dict(rank=2, dropout=1.5), r"--lora-dropout must be in \[0, 1\), got 1.5")):
        with pytest.raises(ConfigError, match=match):
            LoraSettings(**bad)


def test_the_adapters_follow_the_split_of_their_base():
    colwise, rowwise = ColwiseParallel(), RowwiseParallel()
    plan = lora_tp_plan({"layer.self_attn": PrepareModuleInput(), "layer.self_attn.q_proj": colwise,
                         "layer.self_attn.o_proj": rowwise, "layer.mlp.up_proj": ColwiseParallel()},
                        ["layer.self_attn.q_proj", "layer.self_attn.o_proj"])
    assert plan["layer.self_attn.q_proj.base_layer"] is colwise and plan["layer.self_attn.o_proj.base_layer"] is rowwise
    assert isinstance(plan["layer.self_attn.q_proj.lora_B.default"], ColwiseParallel)  # B by rows, A whole
    assert isinstance(plan["layer.self_attn.q_proj.lora_A.default"], PrepareModuleInput)
    assert isinstance(plan["layer.self_attn.o_proj.lora_A.default"], RowwiseParallel)  # A by columns, B whole
    assert "layer.self_attn.o_proj.lora_B.default" not in plan
    assert isinstance(plan["layer.mlp.up_proj"], ColwiseParallel) and "layer.self_attn" in plan  # not adapted: kept
    fused = lora_tp_plan({"layer.attn.c_attn": Conv1DParallel("colwise", parts=3),
                          "layer.attn.c_proj": Conv1DParallel("rowwise")}, ["layer.attn.c_attn", "layer.attn.c_proj"])
    b = fused["layer.attn.c_attn.lora_B.default"]
    assert isinstance(b, FusedColwiseParallel) and b.parts == 3  # q, k and v of B split as c_attn's
    assert isinstance(fused["layer.attn.c_proj.lora_A.default"], RowwiseParallel)


def _blocks(**settings):
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from pipetrain.lora import LoraBlocks
    from pipetrain.workloads.hf.workload import HFWorkload

    return LoraBlocks(HFWorkload().model("llama-tiny"), LoraSettings(**settings))


def test_peft_layers_go_on_the_family_projections_and_freeze_the_base():
    model = _blocks(rank=2)
    torch.manual_seed(0)
    layer, embedding = model.build_block(1), model.build_block(0)
    trained = {n for n, p in layer.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A.default." in n or ".lora_B.default." in n for n in trained)
    assert {n.split(".")[2] for n in trained} == set(model.inner.family.lora_targets)
    assert not any(p.requires_grad for p in embedding.parameters())  # no target there: frozen, untouched
    keys = model.parameter_keys(1)
    assert keys["layer.self_attn.q_proj.lora_A.default.weight"] == "model.layers.0.self_attn.q_proj.lora_A.default.weight"


def test_the_planner_counts_the_frozen_base_of_a_lora_model():
    from pipetrain.train.layout import frozen_costs

    model = _blocks(rank=2)
    base = [BlockCost(name=str(i), params=sum(p.numel() for n, p in model.inner.build_block(i).named_parameters()),
                      param_bytes=1.0, activation_bytes=0.0, output_bytes=0.0) for i in range(model.num_blocks)]
    costs = frozen_costs(base, model)
    assert costs[0].frozen_params == costs[0].params == base[0].params  # the embedding: all frozen
    layer = costs[1]
    adapters = layer.params - base[1].params
    assert adapters > 0 and layer.frozen_params == base[1].params and 0 < layer.trained_share < 0.2


def _code(argv: list[str], capsys) -> tuple[int, str]:
    code = cli_main.main(argv)
    return code, capsys.readouterr().err


def test_lora_targets_naming_no_module_lists_the_projections(capsys):
    pytest.importorskip("peft")
    code, err = _code(["train", "--workload", "hf", "--preset", "llama-tiny", "--data", "synthetic", "--lora-rank", "2",
                       "--lora-targets", "q_proj,qproj", "--print-config"], capsys)
    assert code == 2 and err.count("error") == 1 and "Traceback" not in err
    assert "--lora-targets q_proj,qproj: 'qproj' names no module or parameter of the model" in err
    assert "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj" in err


@pytest.mark.parametrize("workload", ["lm", "classifier"])
def test_lora_on_a_workload_without_a_family_description_is_refused(workload, capsys):
    pytest.importorskip("peft")
    code, err = _code(["train", "--workload", workload, "--preset", "tiny", "--data", "synthetic", "--lora-rank", "4",
                       "--print-config"], capsys)
    assert code == 2 and "Traceback" not in err
    assert f"--lora-rank 4: workload {workload!r} has no family description naming its projections" in err
    assert "--workload hf" in err


def test_a_lora_flag_without_a_rank_is_refused(capsys):
    code, err = _code(["train", "--workload", "hf", "--preset", "llama-tiny", "--data", "synthetic",
                       "--lora-dropout", "0.1", "--print-config"], capsys)
    assert code == 2 and "--lora-dropout applies to LoRA adapters, but --lora-rank is not given" in err


def test_peft_export_of_a_full_fine_tune_is_refused(tmp_path: Path, capsys):
    folder = tmp_path / "step-00000003"
    folder.mkdir()
    write_meta(folder, CheckpointMeta(step=3, model="hf:llama-tiny", fingerprint="x", layout={}, world_size=2,
                                      config={"workload": "hf", "preset": "llama-tiny", "lora": None}, extras={}))
    code, err = _code(["export", str(folder), str(tmp_path / "out"), "--peft"], capsys)
    assert code == 2 and "Traceback" not in err
    assert f"--peft: checkpoint {str(folder)!r} is a full fine-tune (every parameter trained)" in err
    assert "export it with --hf" in err and not (tmp_path / "out").exists()


def test_parameter_groups_leave_frozen_parameters_out():
    from torch import nn

    from pipetrain.recipe import build_optimizer, no_decay_names, param_groups

    net = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.LayerNorm(4))
    net[0].weight.requires_grad_(False)
    net[1].weight.requires_grad_(False)
    groups = param_groups(net, 0.1)
    held = {id(p) for g in groups for p in g["params"]}
    assert held == {id(net[1].bias), id(net[2].weight), id(net[2].bias)}
    assert no_decay_names(net) == {"1.bias", "2.weight", "2.bias"}
    for p in net.parameters():
        p.requires_grad_(False)
    assert param_groups(net, 0.1) == [{"params": [], "weight_decay": 0.0}]  # a frozen stage: an empty optimizer
    assert build_optimizer(net, 1e-3).param_groups[0]["params"] == []


def test_the_base_identity_sees_a_change_in_the_middle_of_a_weights_file(tmp_path):
    """A base whose weights changed mid-file (a re-saved or damaged shard) is another base (fails on main: only the
    first and last MiB of each file were hashed). Files written before are still compared by their own method."""
    from pipetrain.lora.identity import EDGES, WHOLE, folder_identity

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    header = b'{"w": {"dtype": "F32", "shape": [1572864], "data_offsets": [0, 6291456]}}'
    body = bytearray(torch.arange(1572864, dtype=torch.float32).numpy().tobytes())  # 6 MiB
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(len(header).to_bytes(8, "little") + header + bytes(body))
    before, old_before = folder_identity(tmp_path), folder_identity(tmp_path, EDGES)
    body[3 << 20] ^= 1  # one bit, 3 MiB in
    weights.write_bytes(len(header).to_bytes(8, "little") + header + bytes(body))
    after = folder_identity(tmp_path)
    assert after["digest"] != before["digest"] and after.get("method") == WHOLE
    assert len(after["digest"]) == 64 and after["files"] == ["config.json", "model.safetensors"]
    assert "method" not in old_before and folder_identity(tmp_path, EDGES)["digest"] == old_before["digest"]


def test_parameters_are_targets_of_their_own():
    """`module.parameter` targets (a router's weight, fused experts) become PEFT's `target_parameters`; module
    names stay `target_modules`."""
    pytest.importorskip("peft")
    settings = LoraSettings(rank=2, targets="q_proj,gate.weight,experts.gate_up_proj")
    config = settings.peft_config(settings.targets)
    assert set(config.target_modules) == {"q_proj"}
    assert set(config.target_parameters) == {"gate.weight", "experts.gate_up_proj"}
    assert LoraSettings(rank=2).peft_config(("q_proj",)).target_parameters is None

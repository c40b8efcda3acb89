"""`pipetrain plan --gpu NAME`: the data sheets of named GPUs, one rule from a sheet to the planner's figures, and
which device a plan uses when this machine's CPU calibration sits in its default place."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipetrain.cli.main import main
from pipetrain.plan.gpus import GPUS
from pipetrain.plan.hardware import NODES, named_gpu

ROOT = Path(__file__).resolve().parents[2]
CPU_CALIBRATION = ROOT / "tests" / "fixtures" / "cpu-calibration.json"
#: a small plan (the reference Transformer's `gpu` preset; the issue planned 405B on 512 GPUs: the same path, slower)
SMALL = ["plan", "--preset", "gpu", "--gpus", "8", "--batch", "64", "--top", "1", "--pp", "2", "--chunks", "4"]


def test_every_sheet_names_its_source_and_orders_its_rates():
    for name, gpu in GPUS.items():
        assert gpu.source and gpu.memory_gb > 0, name
        assert gpu.bf16_flops >= gpu.tf32_flops >= gpu.fp32_flops > 0, name
        bf16, _ = named_gpu(name, "bf16")
        fp32, network = named_gpu(name, "fp32")
        assert bf16.flops_per_s == pytest.approx(0.96 * gpu.bf16_flops)
        assert fp32.flops_per_s == pytest.approx(0.96 * gpu.tf32_flops)
        assert network.collective_bytes_per_s == pytest.approx(0.8 * gpu.link_bytes_per_s)
        assert bf16.memory_bytes == gpu.memory_gb * 2**30


def test_the_older_node_figures_are_the_sheets_by_the_same_rule():
    """The stated nodes the planner was validated on (torchtitan's 405B rows) move by under 1 %."""
    a100, a100_net = NODES["a100"]
    h100, h100_net = NODES["h100"]
    assert a100.flops_per_s == pytest.approx(150e12, rel=0.01) and h100.flops_per_s == pytest.approx(475e12, rel=0.01)
    assert a100.bytes_per_s == pytest.approx(1.5e12, rel=0.03) and h100.bytes_per_s == pytest.approx(2.5e12, rel=0.01)
    assert (a100_net.collective_bytes_per_s, h100_net.collective_bytes_per_s) == (240e9, 360e9)
    assert (a100_net.inter_bytes_per_s, h100_net.inter_bytes_per_s) == (20e9, 40e9)


def test_plan_on_a_named_gpu_says_so(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert main([*SMALL, "--gpu", "H200", "--precision", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "H200 SXM 141 GB (data sheet) at bf16: 950 TFLOP/s effective, 141 GB" in out
    assert "141.0 GB each" in out


def test_a_cpu_calibration_in_its_default_place_is_not_taken_for_gpus_of_a_stated_memory(capsys, tmp_path,
                                                                                          monkeypatch):
    """The issue's case: after `plan --calibrate` on a laptop, a plan for 512 GPUs of 96 GB at bf16 used to stop
    with "holds fp32 rates" (or, at fp32, plan 512 GPUs as this CPU)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    default = tmp_path / ".cache" / "pipetrain" / "calibration.json"
    default.parent.mkdir(parents=True)
    default.write_text(CPU_CALIBRATION.read_text())
    assert main([*SMALL, "--gpu-mem", "96", "--precision", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "built-in A100-class figures at bf16" in out and "holds this machine's CPU" in out
    assert "96.0 GB each" in out


def test_a_named_gpu_refuses_an_explicit_cpu_calibration(capsys, tmp_path):
    code = main([*SMALL, "--gpu", "h100", "--calibration", str(CPU_CALIBRATION)])
    err = capsys.readouterr().err
    assert code == 2 and "was measured on a CPU, not on the --gpu h100" in err and "Traceback" not in err


def test_gpu_node_is_a_deprecated_spelling_of_gpu(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    common = [*SMALL, "--precision", "bf16"]
    with pytest.warns(DeprecationWarning, match="--gpu h100-sxm"):
        assert main([*common, "--gpu-node", "h100"]) == 0
    old = capsys.readouterr().out
    assert main([*common, "--gpu", "h100-sxm"]) == 0
    new = capsys.readouterr().out
    cut = lambda text: [line for line in text.splitlines() if "layouts," not in line]  # noqa: E731 (search time)
    assert cut(old) == cut(new)


def test_an_unknown_gpu_is_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["plan", "--gpus", "8", "--gpu", "v100"])
    assert stop.value.code == 2 and "invalid choice: 'v100'" in capsys.readouterr().err


def test_the_sheets_are_json_serialisable_for_the_docs_table():
    json.dumps({name: vars(gpu) for name, gpu in GPUS.items()})

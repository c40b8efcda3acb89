"""`--ep` on the command line: bad values are refused with one line and exit 2 before any rank starts (the CLI runs
in this process with the launcher patched to fail, as tests/unit/test_cli_errors.py does)."""

from __future__ import annotations

from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from tests.hf_folders import tiny_tokenizer  # noqa: E402
from tests.moe_folders import moe_configs  # noqa: E402
from tests.unit.test_cli_errors import cli  # noqa: E402,F401  (the fixture)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    """A tiny Qwen3-MoE folder (8 experts) with a tokenizer, as `pipetrain train --workload hf` reads it."""
    import torch

    path = tmp_path_factory.mktemp("moe-ep-cli") / "qwen3"
    tok = tiny_tokenizer()
    config = moe_configs()["qwen3_moe"]
    config.vocab_size = len(tok)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _hf(folder: str, *flags: str) -> list[str]:
    return ["train", "--workload", "hf", "--model", folder, "--data", "synthetic", "--train-samples", "16",
            "--test-samples", "8", "--batch-size", "8", "--seq-len", "16", "--epochs", "1", "--no-progress",
            "--pp", "2", "--chunks", "2", *flags]


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("pipetrain: error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(("flags", "message"), [
    (("--dp", "2", "--ep", "3"), "--ep 3 does not divide the 2 data-parallel ranks of each stage"),
    (("--dp", "3", "--ep", "3", "--batch-size", "6"), "--ep 3 does not divide the 8 experts of the model's MoE layers"),
    (("--dp", "2", "--ep", "2", "--tp", "4", "--dp-mode", "fsdp"), "tp=4 does not divide the model's num_key_value_heads=2"),
    (("--dp", "4", "--ep", "4", "--dp-mode", "hsdp", "--dp-shard", "2"),
     "--ep 4 with --dp-mode hsdp --dp-shard 2: expert parallelism borrows ranks of one shard group, and ep does not "
     "divide it"),
    (("--dp", "2", "--ep", "2", "--dp-mode", "fsdp", "--lora-rank", "2", "--lora-targets", "q_proj,experts.down_proj"),
     "--ep 2 --dp-mode fsdp with LoRA adapters on the experts (layer.mlp.experts): FSDP2 does not gather the adapters"),
    (("--dp", "2", "--ep", "2", "--moe-overlap", "on"), "--moe-overlap on overlaps DualPipeV's fused forward-and-"
                                                         "backward actions; schedule '1f1b' has none"),
    (("--dp", "2", "--dp-mode", "fsdp", "--schedule", "dualpipev", "--chunks", "4", "--moe-overlap", "on"),
     "--moe-overlap on hides the experts' all-to-all behind computation, but with ep=1 there is none"),
])
def test_bad_ep_is_one_line_and_exit_2(cli, folder, flags, message):
    code, _, err, _ = cli(_hf(folder, *flags))
    assert code == 2
    assert message in _one_line(err)


def test_ep_on_a_dense_model_is_one_line_and_exit_2(cli):
    code, _, err, _ = cli(["train", "--preset", "tiny", "--epochs", "1", "--no-progress", "--data", "synthetic",
                           "--train-samples", "64", "--test-samples", "32", "--dp", "2", "--ep", "2"])
    assert code == 2
    assert "--ep 2 splits the experts of MoE layers, but the model" in _one_line(err)
    assert "has none" in err


def test_layout_auto_chooses_or_keeps_the_expert_parallel_degree(folder, monkeypatch, capsys, tmp_path):
    """`--layout auto` on a MoE folder: a given --ep is kept (and the layout chosen around it), else ep is searched."""
    from pipetrain.cli import main as cli_main
    from pipetrain.cli import train_run as train_cli

    spawned = []
    monkeypatch.setattr(train_cli, "spawn", lambda *a, **k: spawned.append(k["args"][0]))
    monkeypatch.chdir(tmp_path)
    calibration = Path(__file__).resolve().parent.parent / "fixtures" / "cpu-calibration.json"
    argv = [*_hf(folder, "--layout", "auto", "--calibration", str(calibration), "--nproc", "4", "--dp-mode", "ddp")]
    assert cli_main.main([*argv, "--ep", "2"]) == 0, capsys.readouterr().err
    config = spawned[-1]
    assert (config.parallel.ep, config.parallel.dp, config.parallel.pipeline.pp) == (2, 2, 2)
    assert cli_main.main(argv) == 0
    assert spawned[-1].parallel.ep in (1, 2) and spawned[-1].parallel.dp == 2


def test_a_moe_folder_is_split_by_its_priced_cost_by_default(folder, monkeypatch, capsys, tmp_path):
    """Without --partition a MoE folder's stages balance the planner's FLOPs (dense embedding and head weigh unlike
    MoE layers); --partition uniform keeps the count split."""
    from pipetrain.cli import main as cli_main
    from pipetrain.cli import train_run as train_cli
    from pipetrain.plan.transformer import load_sizes
    from pipetrain.partition.solver import solve_balance, uniform_balance

    spawned = []
    monkeypatch.setattr(train_cli, "spawn", lambda *a, **k: spawned.append(k["args"][0]))
    monkeypatch.chdir(tmp_path)
    assert cli_main.main(_hf(folder, "--pp", "4", "--chunks", "4")) == 0, capsys.readouterr().err
    blocks = load_sizes(folder).blocks(16, element=4)
    priced = tuple(solve_balance([b.forward_flops for b in blocks], 4))
    assert spawned[-1].parallel.pipeline.balance == priced != tuple(uniform_balance(len(blocks), 4))
    assert cli_main.main(_hf(folder, "--pp", "4", "--chunks", "4", "--partition", "uniform")) == 0
    assert spawned[-1].parallel.pipeline.balance is None and spawned[-1].parallel.pipeline.partition == "uniform"


@pytest.mark.parametrize(("value", "message"), [
    ("0", "--moe-capacity 0.0 is not a positive number"),
    ("-1", "--moe-capacity -1.0 is not a positive number"),
    ("nan", "--moe-capacity nan is not a positive number"),
    ("abc", "--moe-capacity 'abc' is not a positive number"),
])
def test_bad_moe_capacity_is_one_line_and_exit_2(cli, folder, value, message):
    code, _, err, _ = cli(_hf(folder, "--moe-capacity", value))
    assert code == 2
    assert message in _one_line(err)


def test_moe_capacity_on_a_dense_model_is_one_line_and_exit_2(cli):
    code, _, err, _ = cli(["train", "--preset", "tiny", "--epochs", "1", "--no-progress", "--data", "synthetic",
                           "--train-samples", "64", "--test-samples", "32", "--moe-capacity", "1.25"])
    assert code == 2
    assert "--moe-capacity 1.25 caps the tokens each expert of a mixture of experts takes" in _one_line(err)


def test_bad_ep_in_generate_and_eval_is_one_line_and_exit_2(cli, folder, tmp_path):
    code, _, err, _ = cli(["generate", "--model", folder, "--prompt", "the cat", "--pp", "2", "--ep", "3"])
    assert code == 2
    assert "--ep 3 does not divide the 8 experts of the model's MoE layers" in _one_line(err)
    data = tmp_path / "text.txt"
    data.write_text("the cat sat on the mat\n" * 40)
    code, _, err, _ = cli(["eval", "--model", folder, "--data", str(data), "--pp", "2", "--ep", "2"])
    assert code == 2
    assert "--ep 2 does not divide the 1 data-parallel ranks of each stage" in _one_line(err)

"""A decoder LM priced from its config.json alone (`pipetrain.plan.transformer`): parameter counts equal transformers'
own models for every family, FLOPs equal the run's MFU arithmetic, activations reduce to Korthikanti et al.'s, bad
input gets one message, `plan --model` and `train --layout auto` use it."""

from __future__ import annotations

import json
import logging
import os

import pytest

from pipetrain.cli import main as cli_main
from pipetrain.errors import ConfigError
from pipetrain.plan.model import transformer_activation_bytes
from pipetrain.plan.transformer import load_sizes, sizes_from_config

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
FAMILIES = {  # config class, keyword arguments: every family, with the variants that change the counts
    "llama": ("LlamaConfig", dict(SMALL, tie_word_embeddings=True)),
    "llama-biases": ("LlamaConfig", dict(SMALL, attention_bias=True, mlp_bias=True)),
    "qwen2": ("Qwen2Config", dict(SMALL)),
    "qwen3": ("Qwen3Config", dict(SMALL, head_dim=24, attention_bias=True)),
    "mistral": ("MistralConfig", dict(SMALL, head_dim=8)),
    "gemma": ("GemmaConfig", dict(SMALL, head_dim=32)),
    "phi3": ("Phi3Config", dict(SMALL, pad_token_id=0)),
    "olmo2": ("Olmo2Config", dict(SMALL, attention_bias=True, pad_token_id=0)),
    "gpt2": ("GPT2Config", dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64)),
    "gpt2-untied": ("GPT2Config", dict(vocab_size=128, n_embd=64, n_layer=3, n_head=4, n_inner=80,
                                       tie_word_embeddings=False)),
}


def _config(name: str):
    transformers = pytest.importorskip("transformers")
    cls, kwargs = FAMILIES[name]
    return getattr(transformers, cls)(**kwargs)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_parameters_equal_transformers_own_model(name, tmp_path):
    transformers = pytest.importorskip("transformers")
    config = _config(name)
    config.save_pretrained(tmp_path)
    sizes = load_sizes(tmp_path)  # the folder's config.json, read as JSON
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert sizes.params() == model.num_parameters()
    layer = model.model.layers[0] if hasattr(model, "model") else model.transformer.h[0]
    assert sizes.layer_params() == sum(p.numel() for p in layer.parameters())
    assert load_sizes(tmp_path / "config.json") == sizes  # a bare config.json reads the same


@pytest.mark.parametrize("name", list(FAMILIES))
def test_products_are_the_models_matrix_products_in_order(name):
    """`layer_products` (what `--selective-matmuls alternate` counts: keep the 1st, 3rd, ...) lists the output widths
    of the matrix products transformers' own model runs, in its order: each layer's, then the head's."""
    transformers = pytest.importorskip("transformers")
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from pipetrain.pipeline.recompute import MATMUL_OPS

    class Products(TorchDispatchMode):
        widths: list[int] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in MATMUL_OPS:
                self.widths.append(out.shape[-1])
            return out

    config = _config(name)
    config._attn_implementation = "sdpa"
    sizes = sizes_from_config(config.to_dict())
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad(), Products() as products:
        model(torch.randint(0, sizes.vocab, (1, 8)))
    assert products.widths == sizes.layer_products() * sizes.layers + [sizes.vocab]
    kept = sizes.layer_products()[::2]
    assert sizes.layer_selective_bytes(8, 2, "alternate") == 2 * 8 * (sizes.hidden + sizes.q_width + sum(kept))
    assert sizes.layer_selective_bytes(8, 2, "alternate") < sizes.layer_selective_bytes(8, 2)


@pytest.mark.parametrize("name", ["llama", "gpt2-untied"])
def test_flops_are_the_runs_mfu_arithmetic(name):
    pytest.importorskip("transformers")
    from pipetrain.logs.meter import model_flops
    from pipetrain.workloads.hf.causal_lm import HFCausalLM

    config = _config(name)
    sizes = sizes_from_config(config.to_dict())
    model = HFCausalLM(config, seq_len=32)
    flops = model_flops(model)
    assert (flops.params, flops.layers, flops.heads, flops.head_dim) == (
        sizes.flops_params(), sizes.layers, sizes.heads, sizes.head_dim)
    assert sizes.flops_per_token(32) == flops.per_token(32)
    blocks = sizes.blocks(32)
    assert len(blocks) == model.num_blocks
    # forward + backward of the blocks' matmuls and attention = the PaLM count less its norms' and biases' 6 FLOPs
    others = (sizes.layers * (sizes.layer_params() - sizes.matmul_params()) + sizes.head_params()
              - sizes.vocab * sizes.hidden)
    assert 3 * sum(b.forward_flops for b in blocks) == 32 * (sizes.flops_per_token(32) - 6 * others)


def test_activations_reduce_to_korthikanti_for_a_gpt_layer():
    s, h, a = 512, 1024, 16
    gpt = sizes_from_config({"model_type": "gpt2", "n_embd": h, "n_head": a, "n_layer": 2, "vocab_size": 1000})
    kept, split = gpt.layer_activation_bytes(s, 2)  # flash attention: the paper's selective count, 34·s·h
    assert kept == transformer_activation_bytes(s, 1, h, a, recompute="selective") == 34 * s * h
    for tp in (2, 4, 8):  # s·h·(10 + 24/t) per rank, Korthikanti et al. 2022, Table 2
        assert kept - split + split / tp == transformer_activation_bytes(s, 1, h, a, recompute="selective", tp=tp)


def test_a_family_it_cannot_price_and_a_folder_without_config_get_one_message(tmp_path):
    with pytest.raises(ConfigError) as err:
        sizes_from_config({"model_type": "mamba", "hidden_size": 64}, "x/config.json")
    assert "'mamba'" in str(err.value) and "heads" in str(err.value) and "llama" in err.value.hint
    with pytest.raises(ConfigError, match="has no config.json"):
        load_sizes(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ConfigError, match="num_attention_heads is None"):
        load_sizes(tmp_path)


@pytest.mark.parametrize("argv,message", [
    (["--model", "{empty}"], "has no config.json"),
    (["--model", "{mamba}"], "holds a 'mamba' model, which the planner cannot price"),
    (["--model", "{llama}", "--seq-len", "4096"], "longer than the model's 64 positions"),
    (["--model", "{llama}", "--preset", "cpu"], "both --model and --preset"),
    (["--model", "{llama}", "--float8"], "--float8 trains Float8 projections in a bf16 job"),
])
def test_plan_model_refusals_exit_2(argv, message, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "mamba").mkdir()
    (tmp_path / "mamba" / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps(dict(SMALL, model_type="llama")))
    argv = [a.format(empty=tmp_path / "empty", mamba=tmp_path / "mamba", llama=tmp_path / "llama") for a in argv]
    assert cli_main.main(["plan", "--gpus", "4", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_plan_model_prints_the_model_and_a_train_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(dict(SMALL, model_type="qwen3", head_dim=16)))
    assert cli_main.main(["plan", "--gpus", "4", "--model", str(tmp_path / "config.json"), "--seq-len", "32",
                          "--batch", "16", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "qwen3: 2 layers, hidden 64" in out and "training FLOPs per token" in out and "at tp=2" in out
    assert f"--workload hf --model {tmp_path} --seq-len 32" in out
    assert "per schedule" in out and "tokens/s/GPU" in out


def test_layout_auto_prices_an_hf_folder_from_its_config(tmp_path, monkeypatch, caplog):
    pytest.importorskip("transformers")
    from pathlib import Path

    from pipetrain.cli import train_run as train_cli
    from tests.hf_folders import tiny_model_folder

    folder = tiny_model_folder(tmp_path / "model", "llama")
    calibration = Path(__file__).resolve().parent.parent / "fixtures" / "cpu-calibration.json"
    for name in list(os.environ):
        if name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") or name.startswith("SLURM_"):
            monkeypatch.delenv(name)
    spawned = []
    monkeypatch.setattr(train_cli, "spawn", lambda *a, **k: spawned.append(k["args"][0]))
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--layout", "auto", "--workload", "hf", "--model", str(folder), "--data", "synthetic",
            "--train-samples", "32", "--test-samples", "8", "--batch-size", "8", "--seq-len", "32", "--no-progress",
            "--calibration", str(calibration)]
    with caplog.at_level(logging.INFO, logger="pipetrain"):
        assert cli_main.main(argv) == 0
    assert "config.json priced at seq len 32" in caplog.text and "measuring each block" not in caplog.text
    local = spawned[-1]
    ran = []  # a launched rank decides from the config file alone: no --profile needed
    monkeypatch.setattr(train_cli, "_rank_main", lambda spec, config, data, metrics: ran.append(config))
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    assert cli_main.main(argv) == 0 and ran[-1].parallel == local.parallel


def test_state_bytes_per_precision_under_fsdp_and_ddp():
    from pipetrain.plan.predict import Layout, static_bytes

    sizes = sizes_from_config(dict(SMALL, model_type="llama"))
    layer = sizes.blocks(16)[1:2]
    p, m = sizes.layer_params(), sizes.matmul_params()
    fsdp = dict(dp=4, pp=1, batch=8, chunks=1, dp_mode="fsdp")
    assert static_bytes(layer, Layout(**fsdp)) == 2 * 4 * p + 4 * 4 * p / 4  # fp32: gathered weights, grads, shards
    assert static_bytes(layer, Layout(**fsdp, precision="bf16")) == 2 * p + 4 * p + 16 * p / 4
    assert static_bytes(layer, Layout(**fsdp, precision="bf16", float8=True)) == 2 * (p - m) + m + 4 * p + 4 * p
    ddp = dict(fsdp, dp_mode="ddp")  # DDP keeps fp32 weights under bf16 autocast: the same in both
    assert static_bytes(layer, Layout(**ddp)) == static_bytes(layer, Layout(**ddp, precision="bf16")) == 5 * 4 * p
    split = static_bytes(layer, Layout(**fsdp, precision="bf16", float8=True, tp=2))
    mine = p - m / 2  # tp=2 halves the projection weights (llama has no biases), the norms stay whole
    assert split == pytest.approx(2 * (mine - m / 2) + m / 2 + 4 * mine + 16 * mine / 4)


def test_per_layer_recomputation_keeps_every_layer_input():
    from pipetrain.plan.hardware import DEFAULT_NETWORK, default_device
    from pipetrain.plan.predict import Layout, stage_costs

    sizes = sizes_from_config(dict(SMALL, model_type="llama", num_hidden_layers=6))
    blocks = sizes.blocks(16, element=2)
    stage = Layout(dp=1, pp=2, batch=4, chunks=2, checkpoint="always")
    layer = Layout(dp=1, pp=2, batch=4, chunks=2, checkpoint="always", recompute_unit="layer")
    bounds = [(0, 4), (4, 8)]
    whole = stage_costs(blocks, stage, default_device(), DEFAULT_NETWORK, bounds)
    each = stage_costs(blocks, layer, default_device(), DEFAULT_NETWORK, bounds)
    samples, hidden = 2, 2 * 16 * 64  # bytes of one sample's hidden states
    assert whole[1].held_bytes is None and whole[1].input_bytes == samples * hidden  # the stage's input only
    # stage 1: the inputs of 3 layers and of the head; not the stage's output (the logits die with the loss's forward,
    # which runs in the last stage's: plan/loss.py)
    assert each[1].held_bytes == samples * 4 * hidden
    assert each[0].held_bytes == samples * 4 * hidden  # 3 layer inputs and the output (the ids are not counted)
    # recomputing block k brings back its activations and its backward's working bytes beside the inputs the blocks
    # before it kept (not the logits: they died with the loss's forward); the blocks after it have run their backward
    # and freed what they kept
    peaks = [k * hidden + b.activation_bytes + b.backward_bytes for k, b in enumerate(blocks[4:8])]
    assert each[1].recompute_bytes == samples * max(peaks)


def test_an_eager_rmsnorm_layer_keeps_its_two_normalised_tensors():
    """transformers' eager RMSNorm saves `hidden` for `weight * hidden`: 2h per token more than a LayerNorm family
    (whose kernel keeps its mean and rstd only); measured on an eager llama-cpu layer by benchmarks/memory_terms.py
    (2.496 MB saved for 4 x 128 tokens in fp32, 2.469 planned: the rest is rstd, cos/sin and the logsumexp)."""
    s, e, h = 128, 4, 64
    llama = sizes_from_config(dict(SMALL, model_type="llama"))
    kept, split = llama.layer_activation_bytes(s, e)
    q, k, f = llama.q_width, llama.kv_width, llama.intermediate
    assert split == e * s * (2 * q + 2 * k + 4 * f)
    assert kept - split == 6 * e * s * llama.hidden  # the input (the 1st norm's), the 2nd norm's, both normalised, both outputs
    cpu = sizes_from_config({"model_type": "llama", "vocab_size": 1024, "hidden_size": h, "intermediate_size": 172,
                             "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2})
    assert cpu.layer_activation_bytes(s, e)[0] * 4 / 2**20 == pytest.approx(2.46875, rel=1e-12)
    qwen3 = sizes_from_config(dict(SMALL, model_type="qwen3", head_dim=16))
    assert qwen3.layer_activation_bytes(s, e)[1] - split == 2 * e * s * (qwen3.q_width + qwen3.kv_width)

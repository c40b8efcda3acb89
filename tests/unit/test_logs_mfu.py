"""MFU arithmetic against hand-computed values: the PaLM FLOPs per token, the peak table, the parameter count."""

from __future__ import annotations

import pytest

from pipetrain.logs.mfu import ModelFlops, mfu, peak_tflops
from pipetrain.workloads.lm.gpt import GPT_PRESETS, GPTModel
from pipetrain.workloads.classifier.model import PRESETS, TransformerClassifier


def test_flops_per_token_is_6n_plus_12lhqt():
    shape = ModelFlops(params=1000, layers=2, heads=4, head_dim=8)
    assert shape.per_token(16) == 6 * 1000 + 12 * 2 * 4 * 8 * 16 == 18288
    assert shape.per_step(samples=3, seq_len=16) == 18288 * 3 * 16 == 877824


def test_mfu_is_achieved_over_peak_of_all_devices():
    # 877,824 FLOPs in 0.5 s = 1,755,648 FLOP/s; two devices of 1e6 FLOP/s (1e-6 TFLOP/s) each
    assert mfu(877824, 0.5, devices=2, peak_tflops_per_device=1e-6) == pytest.approx(0.877824)
    # 989 TFLOP/s per H100, 8 of them, a step of 4e15 FLOPs in 1.25 s: 3.2e15 / 7.912e15
    assert mfu(4e15, 1.25, devices=8, peak_tflops_per_device=989) == pytest.approx(3.2e15 / 7.912e15)
    with pytest.raises(ValueError):
        mfu(1.0, 0.0, devices=1, peak_tflops_per_device=1.0)


@pytest.mark.parametrize("name, precision, peak", [
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0), ("NVIDIA A100-PCIE-40GB", "fp32-strict", 19.5),
    ("NVIDIA A100-PCIE-40GB", "fp32", 156.0),  # fp32 runs its matmuls in TF32 on CUDA
    ("NVIDIA H100 80GB HBM3", "bf16", 989.0), ("NVIDIA H100 PCIe", "bf16", 756.0),
    ("NVIDIA H100 NVL", "fp32-strict", 60.0), ("NVIDIA H200", "bf16", 989.0), ("NVIDIA H200", "fp32-strict", 67.0),
    ("NVIDIA H200", "fp32", 495.0),
    ("NVIDIA GeForce RTX 4090", "bf16", None), ("NVIDIA H100 80GB HBM3", "fp8", None),
])
def test_peak_table(name, precision, peak):
    assert peak_tflops(name, precision) == peak


def test_classifier_counts_every_parameter_but_the_embedding():
    torch = pytest.importorskip("torch")
    from pipetrain.logs.meter import model_flops

    c = PRESETS["tiny"]
    e, f, k = c.emsize, c.nhid, c.num_classes
    per_layer = 3 * e * e + 3 * e + e * e + e + e * f + f + f * e + e + 4 * e  # attention, MLP, two LayerNorms
    expected = c.nlayers * per_layer + 2 * e + e * k + k  # + the head's LayerNorm and linear layer
    model = TransformerClassifier(c)
    flops = model_flops(model)
    assert flops == ModelFlops(params=expected, layers=c.nlayers, heads=c.nhead, head_dim=e // c.nhead)
    everything = sum(p.numel() for i in range(model.num_blocks) for p in model.build_block(i).parameters())
    assert everything - flops.params == c.vocab_size * e  # exactly the token embedding is left out
    del torch


def test_gpt_leaves_out_token_and_position_tables_but_counts_its_untied_head():
    pytest.importorskip("torch")
    from pipetrain.logs.meter import model_flops

    c = GPT_PRESETS["tiny"]
    model = GPTModel(c)
    flops = model_flops(model)
    everything = sum(p.numel() for i in range(model.num_blocks) for p in model.build_block(i).parameters())
    assert everything - flops.params == (c.vocab_size + c.seq_len) * c.emsize
    assert (flops.layers, flops.heads * flops.head_dim) == (c.nlayers, c.emsize)


def test_hugging_face_llama_counts_its_head_but_not_its_embedding():
    transformers = pytest.importorskip("transformers")
    from pipetrain.logs.meter import model_flops
    from pipetrain.workloads.hf.causal_lm import HFCausalLM

    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = HFCausalLM(config, seq_len=16)
    flops = model_flops(model)
    # per layer: q 32x32, k and v 32x16 each (2 of 4 heads' width), o 32x32, MLP 3 x 32x64, two RMSNorms of 32
    per_layer = 32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 64 + 2 * 32
    assert flops == ModelFlops(params=2 * per_layer + 32 + 32 * 96, layers=2, heads=4, head_dim=8)

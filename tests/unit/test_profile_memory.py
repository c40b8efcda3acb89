"""What a measured profile says of a block's memory beyond its saved activations: what selective recomputation
keeps (`selective_bytes`) and what its backward holds at once (`backward_bytes`). The file keeps both (both
formats; older files without them load as unknown), the fit fits them, and the profiler measures them (selective
through the pipeline's own wrapper): for a Hugging Face Llama layer, what the analytic pricing of its config says."""

from __future__ import annotations

import json
import tempfile
from dataclasses import replace

import pytest

from pipetrain.partition.fit import fit_profiles
from pipetrain.partition.measure import profile_model
from pipetrain.partition.profile import BlockProfile, ModelProfile, load_profile, save_profile
from pipetrain.plan.model import profile_blocks
from pipetrain.plan.transformer import load_sizes
from pipetrain.train.profiling import selective_form
from pipetrain.workloads.hf.causal_lm import HFCausalLM
from pipetrain.workloads.hf.workload import HF_PRESETS
from pipetrain.workloads.lm.gpt import GPT_PRESETS, GPTModel


def _at(size: int) -> ModelProfile:
    blocks = tuple(BlockProfile(index=i, name=f"B{i}", forward_s=1e-3 * size, backward_s=2e-3 * size,
                                param_bytes=400, activation_bytes=100 * size, output_bytes=10 * size,
                                selective_bytes=8 + 60 * size, backward_bytes=30 * size) for i in range(2))
    return ModelProfile(model="m", fingerprint="f" * 64, micro_batch_size=size, device="cpu", dtype="float32",
                        repeats=3, blocks=blocks)


def test_selective_bytes_round_trip_fit_and_reach_the_planner(tmp_path):
    save_profile(_at(4), tmp_path / "one.json")
    assert load_profile(tmp_path / "one.json") == _at(4)
    fitted = fit_profiles([_at(n) for n in (1, 2, 4)], reference=4)
    block = fitted.blocks[0]
    assert (block.selective_fixed_bytes, block.selective_bytes) == (8, 248)
    assert (block.backward_fixed_bytes, block.backward_bytes) == (0, 120)
    save_profile(fitted, tmp_path / "fit.json")
    assert load_profile(tmp_path / "fit.json") == fitted
    assert fitted.rescaled(2).blocks[0].selective_bytes == 128  # the fixed part kept, the rest halved
    assert profile_blocks(fitted)[0].selective_bytes == pytest.approx(60.0)  # per sample, the fixed part left out
    assert profile_blocks(fitted)[0].backward_bytes == pytest.approx(30.0)
    data = json.loads((tmp_path / "fit.json").read_text())  # a format-2 file written before the field existed
    for item in data["blocks"]:
        for key in ("selective_bytes", "selective_fixed_bytes", "backward_bytes", "backward_fixed_bytes"):
            del item[key]
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = load_profile(tmp_path / "old.json")
    assert old.blocks[0].selective_bytes is None and profile_blocks(old)[0].selective_bytes is None
    assert old.blocks[0].backward_bytes is None and profile_blocks(old)[0].backward_bytes == 0.0
    assert fit_profiles([replace(_at(n), blocks=old.blocks) for n in (1, 2)]).blocks[0].selective_bytes is None


def test_the_profiler_measures_what_selective_recomputation_keeps_and_what_a_backward_holds():
    config = HF_PRESETS["llama-cpu"].config()
    measured = profile_model(HFCausalLM(config, seq_len=128), 2, repeats=1, selective=selective_form)
    with tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(folder)
        priced = load_sizes(folder).blocks(128, element=4)
    layer, analytic = measured.blocks[1], priced[1]
    # the layer's input, its q/k/v/o and MLP products and attention's output: what the config's pricing counts
    assert layer.selective_bytes / 2 == pytest.approx(analytic.selective_bytes, rel=0.02)
    assert layer.selective_bytes < 0.7 * layer.activation_bytes
    # its backward's working bytes: a gated MLP's two gradients of its product's factors (`layer_backward_bytes`)
    assert layer.backward_bytes / 2 == pytest.approx(analytic.backward_bytes, rel=0.02)
    plain = profile_model(HFCausalLM(config, seq_len=128), 2, repeats=1)
    assert plain.blocks[1].selective_bytes is None
    gpt = profile_model(GPTModel(replace(GPT_PRESETS["tiny"], dropout=0.0)), 2, repeats=1, selective=selective_form)
    head = gpt.blocks[-1]  # keeps its input (the checkpoint's) but not its logits (the stage holds those)
    assert head.selective_bytes == gpt.blocks[-2].output_bytes < head.output_bytes

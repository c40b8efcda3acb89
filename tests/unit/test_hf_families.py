"""The Hugging Face family descriptions: each names parts that exist in the transformers model and says what its
decoder layer holds (biases, q/k norms, fused projections, post-norms), so a layer's size is read from the config;
each gives the transformers model's logits and initialisation through the one adapter, and a detail removed from a
description (Gemma's embedding scaling, its zero-centred norms, Mistral's and Qwen2's sliding windows) breaks that.
A model type without a description but with the common layout runs on the generic description (said in one line);
one without is refused naming what is missing. No module outside the descriptions branches on a family's name."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pipetrain.blocks import build_sequential  # noqa: E402
from pipetrain.errors import ConfigError  # noqa: E402
from pipetrain.workloads.hf import families  # noqa: E402
from pipetrain.workloads.hf.causal_lm import HFCausalLM  # noqa: E402
from pipetrain.workloads.hf import proof  # noqa: E402
from pipetrain.workloads.hf.families import FAMILIES, MOE_FAMILIES, Family, generic, outside  # noqa: E402
from tests.distributed.test_hf_parity import SEQ, VOCAB, tiny_configs  # noqa: E402
from tests.hf_folders import family_configs  # noqa: E402
from tests.moe_folders import moe_configs  # noqa: E402

SRC = Path(__file__).resolve().parents[2] / "src" / "pipetrain"
RTOL, ATOL = 1e-5, 4e-5
TIED = {"gemma", "gemma2", "gemma3_text", "cohere", "cohere2"}  # the families whose class ties the head by default


def _configs() -> dict:
    return {**tiny_configs(), **family_configs(VOCAB), **moe_configs()}


def _logits(family: Family | None, config, tmp_path, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(ours, transformers') logits of the model of `config` saved to a folder, built by `family` when given."""
    if family is not None:
        monkeypatch.setitem(FAMILIES, config.model_type, family)
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config)
    reference.save_pretrained(tmp_path)  # built from the folder without the proof (`from_folder` proves)
    model = HFCausalLM(transformers.AutoConfig.from_pretrained(tmp_path), checkpoint=tmp_path, seq_len=SEQ)
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    return build_sequential(model, seed=0)(x), reference(input_ids=x).logits


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_description_names_what_the_transformers_model_holds(name):
    family, config = FAMILIES[name], _configs()[name]
    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(config)
    for path in (family.embed, family.position, family.layers, family.norm, family.head):
        if path is not None:
            reference.get_submodule(path)  # raises when the description is wrong
    assert isinstance(reference.get_submodule(f"{family.layers}.0"), family.resolve(family.layer_class))
    assert isinstance(reference.get_submodule(family.norm), family.resolve(family.norm_class))
    model = HFCausalLM(config, seq_len=SEQ)
    ours = {key for index in range(model.num_blocks) for key in model.parameter_keys(index).values()}
    assert ours == set(reference.state_dict())
    # every dense family has a TP plan; of the mixtures of experts, those without are DeepSeek-V3 (latent attention)
    # and GPT-OSS (per-head sinks) (tests/unit/test_moe.py checks the others' plans)
    assert (family.tp_plan is None) == (name in ("deepseek_v3", "gpt_oss")) and family.base == reference.base_model_prefix
    assert model.tied == config.tie_word_embeddings == (name in TIED)  # as each class ties by default


def _layer_size(family: Family, config) -> int:
    """A decoder layer's parameter count read from the config and the description only (what a planner does)."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    mlp = config.intermediate_size
    q, k = heads * head_dim, kv * head_dim
    size = hidden * (q + 2 * k) + q * hidden + 3 * hidden * mlp  # q, k, v, o; gate, up, down
    size += (q + 2 * k) * family.has("qkv_bias", config) + hidden * family.has("o_bias", config)
    size += (2 * mlp + hidden) * family.has("mlp_bias", config)
    size += {"head": 2 * head_dim, "projection": q + k, None: 0}[family.qk_norm]
    norms = 1 if family.parallel_block else 4 if family.sandwich_norms else 2  # Cohere's one, Gemma 2's four
    return size + norms * hidden  # before (or, with post_norms, after) attention and MLP


@pytest.mark.parametrize("name", sorted(set(FAMILIES) - {"gpt2"} - set(MOE_FAMILIES)))
def test_a_description_says_what_its_layer_holds(name):
    family, config = FAMILIES[name], _configs()[name]
    layer = family.resolve(family.layer_class)(config, 0)
    attention, names = layer.self_attn, {n for n, _ in layer.named_parameters()}
    assert sum(p.numel() for p in layer.parameters()) == _layer_size(family, config)
    assert hasattr(attention, "q_norm") == (family.qk_norm is not None)
    if family.qk_norm is not None:
        assert attention.q_norm.weight.numel() == (config.head_dim if family.qk_norm == "head"
                                                   else config.num_attention_heads * attention.head_dim)
    for fused in (family.fused_qkv, family.fused_gate_up):
        assert fused is None or f"{fused}.weight" in names
    assert ("self_attn.q_proj.bias" in names) == family.has("qkv_bias", config)
    assert hasattr(layer, "post_feedforward_layernorm") == (family.post_norms or family.sandwich_norms)
    assert hasattr(layer, "post_attention_layernorm") == (not family.parallel_block)
    assert hasattr(layer, "input_layernorm") == (not family.post_norms)


@pytest.mark.parametrize("name", sorted(family_configs()))
def test_each_family_gives_the_transformers_logits_and_initialisation(name, tmp_path, monkeypatch):
    config = _configs()[name]
    ours, theirs = _logits(None, config, tmp_path, monkeypatch)
    torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=ATOL)
    torch.manual_seed(0)  # untrained: the norms as transformers initialises them (Gemma's at 0)
    fresh = dict(transformers.AutoModelForCausalLM.from_config(config).named_parameters())
    model = HFCausalLM(config, seq_len=SEQ)
    for index in range(model.num_blocks):
        block = model.build_block(index)
        for local, key in model.parameter_keys(index).items():
            if "norm" in key:
                assert torch.equal(block.get_parameter(local), fresh[key]), key


@pytest.mark.parametrize(("name", "removed"), [
    ("gemma", {"embed_scale": False}),  # Gemma's embedding scaling
    ("mistral", {"mask": families.causal_mask}),  # Mistral's sliding window (4 tokens of 16)
    ("qwen2", {"mask": families.causal_mask}),  # Qwen2's sliding layer
    ("granite", {"embed_multiplier": None}),  # Granite's embedding multiplier (12)
    ("granite", {"logit_divisor": None}),  # Granite's logits divisor (8)
    ("cohere", {"logit_multiplier": None}),  # Cohere's logit scale (0.25)
    ("cohere2", {"mask": families.causal_mask}),  # Cohere 2's sliding layer
    ("gemma2", {"logit_softcap": None}),  # Gemma 2's soft cap (0.5)
    ("gemma3_text", {"logit_softcap": None}),  # Gemma 3's soft cap (0.5)
])
def test_a_family_without_a_detail_of_its_description_is_not_that_family(name, removed, tmp_path, monkeypatch):
    config = _configs()[name]
    missing = outside.unapplied(config, dataclasses.replace(FAMILIES[name], **removed))
    if missing:  # a detail outside the layers, in the list of what transformers does there: refused, naming it
        with pytest.raises(ConfigError, match=f"sets {missing[0].flag}=.*acts outside the decoder layers"):
            _logits(dataclasses.replace(FAMILIES[name], **removed), config, tmp_path, monkeypatch)
        monkeypatch.setattr(outside, "OUTSIDE", {})  # without the list, the proof is what refuses it
    else:
        ours, theirs = _logits(dataclasses.replace(FAMILIES[name], **removed), config, tmp_path, monkeypatch)
        assert (ours - theirs).abs().max() > 100 * ATOL  # the detail matters: without it, other logits
    monkeypatch.setitem(FAMILIES, config.model_type, dataclasses.replace(FAMILIES[name], **removed))
    with pytest.raises(ConfigError, match=f"'{name}': pipetrain's blocks do not compute what transformers' class "
                                          "computes: .* a described family that disagrees is a pipetrain bug"):
        proof.prove(config, always=True)


def test_gemma_without_its_zero_centred_norms_is_not_gemma(monkeypatch):
    config = _configs()["gemma"]
    unscaled = dataclasses.replace(FAMILIES["gemma"], norm_init=1.0)
    monkeypatch.setitem(FAMILIES, "gemma", unscaled)
    norm = HFCausalLM(config, seq_len=SEQ).build_block(3).norm.weight
    assert torch.equal(norm, torch.ones(32))  # not transformers' zeros: Gemma's norm would scale by 2


def test_a_model_type_with_the_common_layout_runs_on_the_generic_description(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(generic, "_BUILT", {})
    config = transformers.ArceeConfig(**{k: v for k, v in family_configs()["mistral"].to_dict().items()
                                         if k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                  "num_attention_heads", "num_key_value_heads", "pad_token_id")},
                                      vocab_size=VOCAB, max_position_embeddings=64)
    with caplog.at_level(logging.WARNING, logger="pipetrain"):
        ours, theirs = _logits(None, config, tmp_path, monkeypatch)
        HFCausalLM(config, seq_len=SEQ)  # said once per process
    torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=ATOL)
    lines = [r.getMessage() for r in caplog.records if "generic" in r.getMessage()]
    assert len(lines) == 1 and "'arcee'" in lines[0] and "pipetrain check" in lines[0], lines
    assert "ArceeDecoderLayer" in lines[0]
    family = families.family_of(config)
    assert family.name == "arcee" and family.layers == "model.layers" and family not in FAMILIES.values()
    plan = family.layer_tp_plan(config, 2)  # transformers' own plan for Arcee, as torch's styles
    assert set(plan) == {"layer.self_attn.q_proj", "layer.self_attn.k_proj", "layer.self_attn.v_proj",
                         "layer.self_attn.o_proj", "layer.mlp.up_proj", "layer.mlp.down_proj"}
    with pytest.raises(ConfigError, match=r"num_key_value_heads=2.*--tp among 1, 2"):
        family.layer_tp_plan(config, 4)


@pytest.mark.parametrize(("config", "missing"), [
    (transformers.BertConfig(), "BertLMHeadModel does not have the common layout: no model.embed_tokens (embedding); "
                                "no model.layers (layers); no model.norm (final norm); no model.rotary_emb"),
    (transformers.VaultGemmaConfig(head_dim=8, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=2, vocab_size=VOCAB),
     "model.embed_tokens is a VaultGemmaTextScaledWordEmbedding, not an nn.Embedding"),
])
def test_a_model_type_without_description_or_common_layout_is_refused_naming_what_is_missing(config, missing):
    with pytest.raises(ConfigError) as err:
        families.family_of(config)
    assert f"model type {config.model_type!r} is not supported" in err.value.message
    assert missing in err.value.message, err.value.message
    assert err.value.hint.startswith("supported model types: llama, gpt2, qwen2, qwen3, mistral, gemma, phi3, olmo2")
    assert all(isinstance(family, Family) and key == family.name for key, family in FAMILIES.items())


def test_no_module_outside_the_descriptions_branches_on_a_family_name():
    names = "|".join(FAMILIES)
    pattern = re.compile(rf"""\b(family|family\.name|model_type)\s*(==|!=)"""  # a family compared with anything
                         rf"""|(==|!=|\bin\b)\s*[(\[{{]?\s*["']({names})["']"""  # anything compared with a name
                         rf"""|["']({names})["']\s*(==|!=)""")
    found = [f"{path.relative_to(SRC)}:{number}: {line.strip()}"
             for path in SRC.rglob("*.py") if "families" not in path.parts
             for number, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, found
    for branch in ('if family == "llama":', "if config.model_type in ('gpt2',)", 'elif self.family.name != "qwen3"',
                   'if "gemma" == name:'):
        assert pattern.search(branch), branch
    assert not pattern.search('any(p.name == "seq_len" for p in parameters)')


def test_the_generic_tp_plan_is_transformers_own_or_refused_naming_the_style(monkeypatch):
    monkeypatch.setattr(generic, "_BUILT", {})
    config = family_configs()["qwen3"]
    plan = generic.generic_family(config).layer_tp_plan(config, 2)  # Qwen3 read as if it had no description
    assert type(plan["layer.self_attn.q_norm"]).__name__ == "SequenceParallel"  # its q/k norms over head_dim
    assert set(plan) == {f"layer.{key.removeprefix('layers.*.')}" for key in config.base_model_tp_plan}
    for key, style in (("layers.*.mlp.gate_proj", "packed_colwise"),  # a style pipetrain does not translate
                       ("layers.*.input_layernorm", "replicated_with_grad_allreduce")):  # not on the heads
        monkeypatch.setattr(generic, "_BUILT", {})
        config.base_model_tp_plan = {**type(config).base_model_tp_plan, key: style}
        with pytest.raises(ConfigError, match=f"uses '{style}' \\({re.escape(key)}\\)") as err:
            generic.generic_family(config).layer_tp_plan(config, 2)
        assert "--tp 1" in err.value.hint

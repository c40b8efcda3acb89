"""The Hugging Face family descriptions: each names parts that exist in the transformers model, and a new family
is one description (Qwen2 and Gemma, described here only, give the transformers model's logits through the same
adapter); an unknown model type is refused naming the supported ones."""

from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pipetrain.blocks import build_sequential  # noqa: E402
from pipetrain.workloads.hf import families  # noqa: E402
from pipetrain.workloads.hf.causal_lm import HFCausalLM  # noqa: E402
from pipetrain.workloads.hf.families import FAMILIES, LLAMA, Family, llama_tp_plan  # noqa: E402
from tests.distributed.test_hf_parity import SEQ, VOCAB, tiny_configs  # noqa: E402

#: two families of the next issue, described as it would describe them (not in FAMILIES)
QWEN2 = dataclasses.replace(LLAMA, name="qwen2", layer_class="Qwen2DecoderLayer", norm_class="Qwen2RMSNorm",
                            rotary_class="Qwen2RotaryEmbedding")
GEMMA = dataclasses.replace(LLAMA, name="gemma", layer_class="GemmaDecoderLayer", norm_class="GemmaRMSNorm",
                            rotary_class="GemmaRotaryEmbedding", embed_scale=True)
SMALL = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_description_names_what_the_transformers_model_holds(name):
    family, config = FAMILIES[name], tiny_configs()[name]
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
    assert family.tp_plan is not None and family.base == reference.base_model_prefix


@pytest.mark.parametrize("family, config", [
    (QWEN2, transformers.Qwen2Config(**SMALL)),
    (GEMMA, transformers.GemmaConfig(**SMALL, head_dim=8)),
])
def test_a_new_family_is_one_description(family, config, tmp_path, monkeypatch):
    monkeypatch.setitem(FAMILIES, family.name, family)
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config)
    reference.save_pretrained(tmp_path)
    model = HFCausalLM.from_folder(tmp_path, seq_len=SEQ)
    assert model.tied == config.tie_word_embeddings
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(build_sequential(model, seed=0)(x), reference(input_ids=x).logits, rtol=1e-5, atol=4e-5)
    assert llama_tp_plan(config, 2) and family.tp_plan is llama_tp_plan


def test_an_unknown_model_type_is_refused_by_the_one_lookup():
    with pytest.raises(Exception, match="model type 'bert' is not supported") as err:
        families.family_of(transformers.BertConfig())
    assert "llama, gpt2" in err.value.hint
    assert all(isinstance(family, Family) and key == family.name for key, family in FAMILIES.items())

"""The transformers model types pipetrain splits, one `Family` description each, and the one lookup.

Described: Llama and GPT-2 (`llama.py`, `gpt2.py`); Qwen2 (2.5), Qwen3, Mistral and Gemma as Llama plus what differs
(`llama_shaped.py`); Phi-3 (`phi3.py`: fused projections, partial rotary) and OLMo-2 (`olmo2.py`: post-norms, q/k
norms over all heads); Granite, Cohere and Cohere 2 (`scaled.py`: scaled embedding or logits); Gemma 2 and Gemma 3's
text model (`gemma2.py`: soft-capped logits, alternating sliding windows); the mixtures of experts Qwen3-MoE,
Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V3 and GPT-OSS (`moe.py`). A new family is one more description
added to `FAMILIES`. A model type without one but with transformers' common layout gets the generic description
(`generic.py`, said in one log line); any other is refused naming the supported types and what of the layout is
missing. Whatever the family, a config flag that acts outside the decoder layers (`outside.py`) and that its blocks
do not apply is refused naming the flag.
"""

from __future__ import annotations

from typing import Any

from pipetrain.errors import ConfigError
from pipetrain.workloads.hf.families.family import (Family, causal_mask, layer_types_mask, require_transformers,
                                                    sliding_window_mask, tp_divides)
from pipetrain.workloads.hf.families.gemma2 import GEMMA2, GEMMA3
from pipetrain.workloads.hf.families.generic import COMMON_LAYOUT, generic_family
from pipetrain.workloads.hf.families.gpt2 import GPT2, gpt2_tp_plan
from pipetrain.workloads.hf.families.llama import LLAMA, gathered_attention_tp_plan, llama_tp_plan
from pipetrain.workloads.hf.families.llama_shaped import GEMMA, MISTRAL, QWEN2, QWEN3
from pipetrain.workloads.hf.families.moe import (DEEPSEEK_V3, GPT_OSS, MIXTRAL, MOE_FAMILIES, OLMOE, QWEN2_MOE,
                                                 QWEN3_MOE)
from pipetrain.workloads.hf.families.olmo2 import OLMO2
from pipetrain.workloads.hf.families.outside import unapplied
from pipetrain.workloads.hf.families.phi3 import PHI3, phi3_tp_plan
from pipetrain.workloads.hf.families.scaled import COHERE, COHERE2, GRANITE

__all__ = ["Family", "FAMILIES", "COMMON_LAYOUT", "family_of", "generic_family", "causal_mask", "layer_types_mask",
           "sliding_window_mask", "require_transformers", "tp_divides", "LLAMA", "GPT2", "QWEN2", "QWEN3", "MISTRAL",
           "GEMMA", "PHI3", "OLMO2", "GRANITE", "COHERE", "COHERE2", "GEMMA2", "GEMMA3",
           "QWEN3_MOE", "QWEN2_MOE", "MIXTRAL", "OLMOE", "DEEPSEEK_V3", "GPT_OSS", "MOE_FAMILIES",
           "llama_tp_plan", "gpt2_tp_plan", "phi3_tp_plan", "gathered_attention_tp_plan"]

#: model_type of a transformers config -> its description
FAMILIES: dict[str, Family] = {**{family.name: family for family in (LLAMA, GPT2, QWEN2, QWEN3, MISTRAL, GEMMA, PHI3,
                                                                     OLMO2, GRANITE, COHERE, COHERE2, GEMMA2, GEMMA3)},
                               **MOE_FAMILIES}


def family_of(config: Any) -> Family:
    """The description of `config`'s `model_type`; for another causal LM with the common layout the generic
    description (said in one log line); else a ConfigError naming the supported types and what did not fit, or the
    flag of the config that acts outside the decoder layers and that the family's blocks do not apply."""
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None:
        family = _generic(config, model_type)
    for entry in unapplied(config, family):
        raise ConfigError(f"Hugging Face model type {model_type!r}: its config sets {entry.flag}="
                          f"{getattr(config, entry.flag)!r}, which acts outside the decoder layers ({entry.acts}) and "
                          "which pipetrain's blocks do not apply: they would compute another model",
                          hint=f"pass a config without {entry.flag}, or describe the family (a Family field for it, "
                               "see docs/models.md)")
    return family


def _generic(config: Any, model_type: str | None) -> Family:
    if not model_type:
        raise ConfigError(f"Hugging Face model type of {type(config).__name__} is not supported (it has none)",
                          hint=f"supported model types: {', '.join(FAMILIES)} (causal decoder LMs)")
    try:
        return generic_family(config)
    except ConfigError as err:
        raise ConfigError(err.message,
                          hint=f"supported model types: {', '.join(FAMILIES)} (causal decoder LMs), and others with "
                               f"the common layout ({', '.join(COMMON_LAYOUT.values())}); or {err.hint}") from None

"""The transformers model types pipetrain splits, one `Family` description each, and the one lookup.

A new family (Qwen2, Mistral, Gemma, ...) is one more description in a module of its own, added to `FAMILIES`: its
`model_type`; where the embedding, position embedding, decoder layers, final norm and head live in the transformers
model; the class names of the decoder layer, final norm and rotary tables; what a layer takes (position ids,
rotary tables, how its attention mask is built, e.g. sliding windows); embedding scaling and ties; and the TP plan
of one decoder layer with its divisibility rule (Llama's `llama_tp_plan` fits Qwen2 and Mistral as it is).
"""

from __future__ import annotations

from typing import Any

from pipetrain.errors import ConfigError
from pipetrain.workloads.hf.families.family import Family, causal_mask, require_transformers, tp_divides
from pipetrain.workloads.hf.families.gpt2 import GPT2, gpt2_tp_plan
from pipetrain.workloads.hf.families.llama import LLAMA, llama_tp_plan

__all__ = ["Family", "FAMILIES", "family_of", "causal_mask", "require_transformers", "tp_divides", "LLAMA",
           "GPT2", "llama_tp_plan", "gpt2_tp_plan"]

#: model_type of a transformers config -> its description
FAMILIES: dict[str, Family] = {family.name: family for family in (LLAMA, GPT2)}


def family_of(config: Any) -> Family:
    """The description of `config`'s `model_type`; a ConfigError naming the supported ones for any other."""
    family = FAMILIES.get(getattr(config, "model_type", None))
    if family is None:
        raise ConfigError(
            f"Hugging Face model type {getattr(config, 'model_type', type(config).__name__)!r} is not supported",
            hint=f"supported model types: {', '.join(FAMILIES)} (causal decoder LMs)",
        )
    return family

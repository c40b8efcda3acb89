"""Granite, Cohere (Command R) and Cohere 2 (Command R7B, Command A): Llama's layout and TP plan, each described by
what differs from Llama; all three scale what enters or leaves the decoder layers.

- Granite: the embedding multiplied by `config.embedding_multiplier`, the logits divided by `config.logits_scaling`
  (the residual and attention multipliers act inside `GraniteDecoderLayer`).
- Cohere: the logits multiplied by `config.logit_scale`; one LayerNorm (mean-centred, no bias) before attention and
  MLP run side by side (`parallel_block`); the head tied to the embedding by default. Its optional q/k LayerNorm over
  each head (`use_qk_norm`, Command R+) is computed by the layer; under TP it is refused (not split yet).
- Cohere 2: Cohere's block and logits, with sliding-window layers where `config.layer_types` says so.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pipetrain.errors import ConfigError
from pipetrain.parallel.tensor import TPPlan
from pipetrain.workloads.hf.families.family import layer_types_mask
from pipetrain.workloads.hf.families.llama import LLAMA, llama_tp_plan

__all__ = ["GRANITE", "COHERE", "COHERE2", "cohere_tp_plan"]


def cohere_tp_plan(config: Any, tp: int) -> TPPlan:
    """Llama's plan for a Cohere layer; refused when the layer norms its queries and keys per head (`use_qk_norm`)."""
    if tp > 1 and getattr(config, "use_qk_norm", False):
        raise ConfigError(f"{config.model_type} with use_qk_norm=True cannot be split with --tp {tp} yet (its q/k "
                          "LayerNorm holds a weight per head)", hint="run it with --tp 1")
    return llama_tp_plan(config, tp)


GRANITE = replace(LLAMA, name="granite", layer_class="GraniteDecoderLayer", norm_class="GraniteRMSNorm",
                  rotary_class="GraniteRotaryEmbedding", embed_multiplier="embedding_multiplier",
                  logit_divisor="logits_scaling")
COHERE = replace(LLAMA, name="cohere", layer_class="CohereDecoderLayer", norm_class="CohereLayerNorm",
                 norm_eps="layer_norm_eps", rotary_class="CohereRotaryEmbedding", logit_multiplier="logit_scale",
                 parallel_block=True, mlp_bias=False, tp_plan=cohere_tp_plan,
                 sequence_tp_plan=None)  # one norm for attention and MLP: not described
COHERE2 = replace(COHERE, name="cohere2", layer_class="Cohere2DecoderLayer", norm_class="Cohere2LayerNorm",
                  rotary_class="Cohere2RotaryEmbedding", mask=layer_types_mask)

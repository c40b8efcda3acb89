"""Gemma 2 and Gemma 3 (its text-only causal LM, `gemma3_text`): Gemma's embedding scaling and zero-centred norms, and
Llama's TP plan, described by what differs from Gemma.

- Gemma 2: four norms a layer (before and after attention and MLP: `sandwich_norms`); sliding-window and global
  layers alternating as `config.layer_types` says; the logits soft-capped, `cap * tanh(logits / cap)` with
  `config.final_logit_softcapping` (the attention scores' own soft cap acts inside the layer). transformers runs it
  with eager attention (sdpa cannot soft-cap the scores), and so does pipetrain when the config names none.
- Gemma 3: Gemma 2's layer and logits, plus q/k norms over `head_dim`, and rotary tables of each layer's type (local
  layers rotate with `rope_parameters["sliding_attention"]`, global ones with `["full_attention"]`). Its
  bidirectional attention (`use_bidirectional_attention`, for embedding models) acts on the masks outside the layers
  and is refused (see `outside.py`).
"""

from __future__ import annotations

from dataclasses import replace

from pipetrain.workloads.hf.families.family import layer_types_mask
from pipetrain.workloads.hf.families.llama_shaped import GEMMA

__all__ = ["GEMMA2", "GEMMA3"]

_GEMMA3 = "transformers.models.gemma3.modeling_gemma3."  # gemma3_text's classes live in the gemma3 module

GEMMA2 = replace(GEMMA, name="gemma2", layer_class="Gemma2DecoderLayer", norm_class="Gemma2RMSNorm",
                 rotary_class="Gemma2RotaryEmbedding", mask=layer_types_mask, sandwich_norms=True,
                 logit_softcap="final_logit_softcapping", sequence_tp_plan=None)  # four norms: not described
GEMMA3 = replace(GEMMA2, name="gemma3_text", layer_class=_GEMMA3 + "Gemma3DecoderLayer",
                 norm_class=_GEMMA3 + "Gemma3RMSNorm", rotary_class=_GEMMA3 + "Gemma3RotaryEmbedding",
                 rotary_by_layer_type=True, qk_norm="head")

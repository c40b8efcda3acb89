"""Qwen2 (and 2.5), Qwen3, Mistral and Gemma (1): Llama's layout (`model.embed_tokens`, `model.layers`, `model.norm`,
`lm_head`, `model.rotary_emb`) and Llama's TP plan, each described by what differs from Llama.

- Qwen2: biases on q, k and v; sliding-window layers where `config.layer_types` says "sliding_attention".
- Qwen3: a q/k norm over `head_dim` (one weight of `head_dim` shared by every head: under TP each rank applies it
  to its own heads and the weights' gradients are summed, `Family.layer_tp_plan`); layer types as Qwen2's.
- Mistral: every layer slides over `config.sliding_window` tokens when it is set.
- Gemma: the embedding multiplied by sqrt(hidden_size) (in the embedding's dtype); zero-centred norms
  (`x * (1 + weight)`, initialised to 0 as transformers does); the head tied to the embedding by default.
"""

from __future__ import annotations

from dataclasses import replace

from pipetrain.workloads.hf.families.family import layer_types_mask, sliding_window_mask
from pipetrain.workloads.hf.families.llama import LLAMA

__all__ = ["QWEN2", "QWEN3", "MISTRAL", "GEMMA"]

_PLAIN = {"qkv_bias": False, "o_bias": False, "mlp_bias": False}

QWEN2 = replace(LLAMA, name="qwen2", layer_class="Qwen2DecoderLayer", norm_class="Qwen2RMSNorm",
                rotary_class="Qwen2RotaryEmbedding", mask=layer_types_mask, **{**_PLAIN, "qkv_bias": True})
QWEN3 = replace(LLAMA, name="qwen3", layer_class="Qwen3DecoderLayer", norm_class="Qwen3RMSNorm",
                rotary_class="Qwen3RotaryEmbedding", mask=layer_types_mask, qk_norm="head",
                **{**_PLAIN, "qkv_bias": "attention_bias", "o_bias": "attention_bias"})
MISTRAL = replace(LLAMA, name="mistral", layer_class="MistralDecoderLayer", norm_class="MistralRMSNorm",
                  rotary_class="MistralRotaryEmbedding", mask=sliding_window_mask, **_PLAIN)
GEMMA = replace(LLAMA, name="gemma", layer_class="GemmaDecoderLayer", norm_class="GemmaRMSNorm",
                rotary_class="GemmaRotaryEmbedding", embed_scale=True, norm_init=0.0,
                **{**_PLAIN, "qkv_bias": "attention_bias", "o_bias": "attention_bias"})

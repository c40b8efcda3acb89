"""What transformers' causal LMs compute outside their decoder layers, per model type: data, read by one function.

Each model type's `*ForCausalLM.forward` and `*Model.forward` (and its scaled embedding class) in transformers 5.24
were read for the config flags they use beyond the embedding lookup, the layers, the final norm and the head:
embedding multipliers, logit multipliers and divisors, logit soft caps, the sqrt(hidden_size) embedding scale, the
dropout after the embedding, and flags pipetrain has no block field for (a head bias, a head of another width, a
bidirectional mask). `OUTSIDE` lists them; `docs/models.md` shows the same list. An entry whose `field` names a
`Family` field is something pipetrain's embedding and head blocks apply (a described family sets the field; the
generic description takes it from here); an entry without one, set in a config to a value that acts, is refused
naming the flag (`unapplied`). The same flag name can act differently per model type: Granite divides the logits
by `logits_scaling`, HyperCLOVA X multiplies them by it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Outside", "OUTSIDE", "outside_of", "unapplied", "generic_fields"]


@dataclass(frozen=True)
class Outside:
    """One config flag a model type's transformers class reads outside its decoder layers."""

    flag: str  #: the config field
    acts: str  #: what it does, in words
    neutral: tuple[Any, ...]  #: the values at which it does nothing (empty: it always acts)
    field: str | None  #: the `Family` field that applies it (None: no pipetrain block applies it)

    def acting(self, config: Any) -> bool:
        """Whether `config`'s value of the flag acts (a missing field does not)."""
        if not hasattr(config, self.flag):
            return False
        return not self.neutral or getattr(config, self.flag) not in self.neutral


_SQRT = Outside("hidden_size", "the embedding × sqrt(hidden_size), in the embedding's dtype", (), "embed_scale")
_SOFTCAP = Outside("final_logit_softcapping", "the logits soft-capped: cap · tanh(logits / cap)", (None,),
                   "logit_softcap")
_EMBED_MULT = Outside("embedding_multiplier", "the embedding × embedding_multiplier", (1, 1.0), "embed_multiplier")
_GRANITE = (_EMBED_MULT, Outside("logits_scaling", "the logits ÷ logits_scaling", (1, 1.0), "logit_divisor"))
_COHERE = (Outside("logit_scale", "the logits × logit_scale", (1, 1.0), "logit_multiplier"),)


def _dropout(flag: str) -> tuple[Outside, ...]:
    return (Outside(flag, f"dropout of probability {flag} after the embedding", (0, 0.0, None), "embed_dropout"),)


#: model_type -> the flags its transformers causal LM reads outside the decoder layers (model types absent: none)
OUTSIDE: dict[str, tuple[Outside, ...]] = {
    **dict.fromkeys(("granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoeshared", "granitemoehybrid"),
                    _GRANITE),
    "hyperclovax": (_EMBED_MULT, Outside("logits_scaling", "the logits × logits_scaling (Granite divides by it)",
                                         (1, 1.0), "logit_multiplier")),
    "falcon_h1": (_EMBED_MULT, Outside("lm_head_multiplier", "the logits × lm_head_multiplier", (1, 1.0),
                                       "logit_multiplier")),
    "minicpm3": (Outside("scale_emb", "the embedding × scale_emb", (1, 1.0), "embed_multiplier"),
                 Outside("logits_scaling", "the final hidden states ÷ logits_scaling, before the head", (1, 1.0),
                         "logit_divisor")),
    **dict.fromkeys(("cohere", "cohere2", "cohere2_moe", "cohere_compass_text"), _COHERE),
    "gemma": (_SQRT,),
    **dict.fromkeys(("gemma2", "vaultgemma", "gemma4_unified_text"), (_SQRT, _SOFTCAP)),
    "gemma3_text": (_SQRT, _SOFTCAP, Outside("use_bidirectional_attention", "every mask made bidirectional (an "
                                             "embedding model)", (False, None), None)),
    **dict.fromkeys(("gemma3n_text", "gemma4_text"), (_SQRT, _SOFTCAP, Outside(
        "hidden_size_per_layer_input", "per-layer inputs embedded beside the tokens", (0, None), None))),
    "recurrent_gemma": (_SQRT, Outside("logits_soft_cap", "the logits soft-capped: cap · tanh(logits / cap)",
                                       (None,), "logit_softcap")),
    **dict.fromkeys(("beam", "nanochat"), (_SOFTCAP,)),
    **dict.fromkeys(("inkling2_text", "inkling2_loop_text"), (_SOFTCAP, Outside(
        "unpadded_vocab_size", "the logits cut to the first unpadded_vocab_size columns", (None,), None))),
    "inkling_text": (Outside("logits_mup_width_multiplier", "the final hidden states ÷ logits_mup_width_multiplier",
                             (1, 1.0), "logit_divisor"),
                     Outside("unpadded_vocab_size", "the logits cut to the first unpadded_vocab_size columns",
                             (None,), None)),
    "xlstm": (Outside("output_logit_soft_cap", "the logits soft-capped: cap · tanh(logits / cap)", (None,),
                      "logit_softcap"),),
    "afmoe": (Outside("mup_enabled", "the embedding × sqrt(hidden_size)", (False, None), "embed_scale"),),
    **dict.fromkeys(("biogpt", "xglm"), (Outside("scale_embedding", "the embedding × sqrt(hidden_size)",
                                                 (False, None), "embed_scale"),)),
    "apertus1p5_text": (Outside("output_vocab_size", "a head of output_vocab_size columns, not vocab_size", (None,),
                                None),),
    **dict.fromkeys(("zaya", "phimoe"), (Outside("lm_head_bias", "a bias on the head", (False, None), None),)),
    "modernbert-decoder": (Outside("decoder_bias", "a bias on the head", (False, None), None),),
    "starcoder2": _dropout("embedding_dropout"),
    **dict.fromkeys(("gpt2", "phi", "phi4_multimodal", "codegen", "gptj", "ctrl", "openai-gpt"),
                    _dropout("embd_pdrop")),
    "gpt_neox": _dropout("hidden_dropout"),
    "gpt_neo": _dropout("embed_dropout"),
}


def outside_of(config: Any) -> tuple[Outside, ...]:
    """The flags `config`'s model type reads outside its decoder layers (none for a model type not listed)."""
    return OUTSIDE.get(getattr(config, "model_type", None), ())


def _applies(family: Any, entry: Outside) -> bool:
    value = getattr(family, entry.field)
    return value is True or value == entry.flag


def unapplied(config: Any, family: Any) -> list[Outside]:
    """The flags of `config` that act outside the layers and that `family`'s blocks do not apply."""
    return [entry for entry in outside_of(config)
            if entry.acting(config) and (entry.field is None or not _applies(family, entry))]


def generic_fields(config: Any) -> dict[str, Any]:
    """The `Family` fields that apply what `config`'s model type does outside its layers (for the generic
    description): {"logit_divisor": "logits_scaling", "embed_scale": True, ...}."""
    fields: dict[str, Any] = {}
    for entry in outside_of(config):
        if entry.field is not None and entry.acting(config):
            fields[entry.field] = True if entry.field == "embed_scale" else entry.flag
    return fields

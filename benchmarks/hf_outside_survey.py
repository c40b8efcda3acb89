"""Not a speed benchmark: the survey behind `pipetrain/workloads/hf/families/outside.py`, to redo on a new transformers.

For every model type of `AutoModelForCausalLM`'s mapping, the config fields its causal LM class and its base model
class (the `*Model` the causal LM holds as `self.model`, and any `*ScaledWordEmbedding`) read in their source, less
the fields every decoder reads there (sizes, ids, epsilons, layer types, router bookkeeping); `SCALED` marks a base
model whose source multiplies by `** 0.5` or `sqrt(`. A type whose remaining fields are not all in `OUTSIDE` is
printed with `<- not all listed`: read its source, and add what acts on the numbers outside the layers to the list.
On transformers 5.24 those left are structure (hybrid or recurrent stacks, `layers_block_type`, multimodal parts,
encoder-decoder fields, router bookkeeping) that the common-layout check refuses, or loss-only settings; the
proof at build (`pipetrain.workloads.hf.proof`) is the backstop for anything a list misses.

    .venv/bin/python benchmarks/hf_outside_survey.py            # every causal LM type
    .venv/bin/python benchmarks/hf_outside_survey.py --new      # only the types the list does not cover
"""

from __future__ import annotations

import argparse
import inspect
import re

import transformers
from transformers.models.auto import modeling_auto

from pipetrain.workloads.hf.families.outside import OUTSIDE

#: read outside the layers by nearly every class, and not acting on what the blocks compute (or refused elsewhere)
COMMON = {"hidden_size", "num_hidden_layers", "pad_token_id", "vocab_size", "rms_norm_eps", "layer_norm_eps",
          "norm_eps", "norm_epsilon", "layer_norm_epsilon", "layer_types", "sliding_window", "tie_word_embeddings",
          "output_router_logits", "_attn_implementation", "use_cache", "return_dict", "output_attentions",
          "output_hidden_states", "get_text_config", "num_experts_per_tok", "num_local_experts", "num_experts",
          "router_aux_loss_coef", "is_decoder", "use_return_dict", "is_encoder_decoder", "max_position_embeddings",
          "rope_parameters", "num_logits_to_keep", "text_config", "vision_config", "audio_config",
          # sizes and ids under other names, rotary settings (read by the rotary tables pipetrain builds too)
          "n_embd", "n_layer", "n_layers", "num_layers", "d_model", "head_dim", "bos_token_id", "eos_token_id",
          "image_token_id", "audio_token_id", "video_token_id", "original_max_position_embeddings", "layer_rope_theta"}


def survey() -> list[tuple[str, str, list[str], bool]]:
    """(model type, causal LM class, fields read outside the layers, scaled) for each causal LM type."""
    rows = []
    for model_type, name in sorted(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        try:
            source = inspect.getsource(inspect.getmodule(getattr(transformers, name)))
        except (AttributeError, ImportError, TypeError, OSError):
            continue
        bodies = {m.group(1): m.group(2) for m in re.finditer(r"^class (\w+)\([^)]*\):\n(.*?)(?=^class |\Z)", source,
                                                              re.M | re.S)}
        held = re.search(r"self\.model\s*=\s*(\w+)\(", bodies.get(name, ""))
        base = held.group(1) if held else None
        read: set[str] = set()
        for cls in [name, base, *(k for k in bodies if "ScaledWordEmbedding" in k)]:
            read |= set(re.findall(r"config\.(\w+)", bodies.get(cls or "", "")))
        scaled = bool(base and re.search(r"\*\*\s*0\.5|sqrt\(", bodies.get(base, "")))
        rows.append((model_type, name, sorted(read - COMMON), scaled))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new", action="store_true", help="only the types the list does not cover")
    args = parser.parse_args()
    for model_type, name, read, scaled in survey():
        listed = {entry.flag for entry in OUTSIDE.get(model_type, ())}
        new = bool(set(read) - listed) or (scaled and "hidden_size" not in listed and not listed)
        if new or not args.new:
            print(f"{model_type:28} {name:40} {', '.join(read) or '-'}{'  SCALED' if scaled else ''}"
                  f"{'  <- not all listed' if new else ''}")


if __name__ == "__main__":
    main()

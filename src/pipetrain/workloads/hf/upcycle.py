"""Sparse upcycling: a dense Llama-shaped folder made into a Mixtral folder whose experts start as the dense MLPs.

    python -m pipetrain.workloads.hf.upcycle SRC DST [--experts 4] [--top-k 2] [--aux-loss-coef 0.01] [--seed 0]

Every decoder layer's MLP is copied into each of E experts (`mlp.experts.gate_up_proj [E, 2I, H]`,
`down_proj [E, H, I]`, transformers' fused layout), the router is new (normal, the config's initializer range):
Mixtral renormalises its top-k routing weights to sum to one, so with identical experts the mixture computes the
dense model's function at step 0 whatever the router picks (Komatsuzaki et al. 2023, "Sparse Upcycling"), and
fine-tuning lets the experts drift apart. Attention, norms, embedding and head are copied as they are (Mixtral's
attention is Llama's without biases, with no sliding window here). The folder is written by transformers'
`save_pretrained` (experts per expert on disk, as transformers writes them) with the source's tokenizer files.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

from pipetrain.errors import ConfigError
from pipetrain.workloads.hf.families import require_transformers

__all__ = ["upcycle", "main"]

#: files of a model folder that are not weights or config, copied to the upcycled folder as they are
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                    "generation_config.json", "tokenizer.model", "vocab.json", "merges.txt")


def _llama_shaped(model: torch.nn.Module) -> bool:
    """Whether `model`'s layers are Mixtral's without the experts: q/k/v/o and gate/up/down projections without
    biases, no q/k norms, no sliding window."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers or getattr(model.config, "sliding_window", None) is not None:
        return False
    names = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj")
    for layer in layers:
        parts = dict(layer.named_modules())
        if any(not isinstance(parts.get(n), torch.nn.Linear) or parts[n].bias is not None for n in names) \
                or "self_attn.q_norm" in parts:
            return False
    return True


def _mixtral_config(dense, experts: int, top_k: int, aux_loss_coef: float):
    transformers = require_transformers()
    if not 1 <= top_k <= experts:
        raise ConfigError(f"--top-k {top_k} with --experts {experts}: each token goes to 1..experts experts",
                          hint=f"pass --top-k between 1 and {experts}")
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "initializer_range",
            "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act", "rope_parameters")
    fields = {name: getattr(dense, name) for name in keep if getattr(dense, name, None) is not None}
    return transformers.MixtralConfig(**fields, num_local_experts=experts, num_experts_per_tok=top_k,
                                      router_aux_loss_coef=aux_loss_coef, output_router_logits=aux_loss_coef > 0,
                                      sliding_window=None)


def upcycle(source: str | Path, target: str | Path, *, experts: int = 4, top_k: int = 2,
            aux_loss_coef: float = 0.01, seed: int = 0) -> Path:
    """Write the Mixtral upcycling of the dense folder `source` into `target` (see the module docstring)."""
    transformers = require_transformers()
    source, target = Path(source), Path(target)
    dense = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    if not _llama_shaped(dense):
        raise ConfigError(f"upcycling takes a Llama- or Mistral-shaped model without biases, q/k norms or sliding "
                          f"windows, not this {dense.config.model_type!r} one",
                          hint="pass a folder such as SmolLM2's or a Llama's")
    config = _mixtral_config(dense.config, experts, top_k, aux_loss_coef)
    torch.manual_seed(seed)
    sparse = transformers.MixtralForCausalLM(config).eval()
    state = {k: v for k, v in dense.state_dict().items() if ".mlp." not in k}
    missing, _ = sparse.load_state_dict(state, strict=False)
    with torch.no_grad():
        for layer, mlp in zip(sparse.model.layers, (d.mlp for d in dense.model.layers)):
            gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])  # [2I, H]
            layer.mlp.experts.gate_up_proj.copy_(gate_up.expand(experts, -1, -1))
            layer.mlp.experts.down_proj.copy_(mlp.down_proj.weight.expand(experts, -1, -1))
            layer.mlp.gate.weight.normal_(0.0, config.initializer_range)
    left = [k for k in missing if ".mlp." not in k and not (config.tie_word_embeddings and k == "lm_head.weight")]
    if left:
        raise ConfigError(f"upcycling left {len(left)} weights of {source} unset, e.g. {left[0]}",
                          hint="pass a folder that transformers' LlamaForCausalLM loads whole")
    target.mkdir(parents=True, exist_ok=True)
    sparse.save_pretrained(target)
    for name in _TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipetrain.workloads.hf.upcycle", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="a dense Llama- or Mistral-shaped model folder")
    parser.add_argument("target", type=Path, help="the Mixtral folder to write")
    parser.add_argument("--experts", type=int, default=4, help="experts per layer (default: 4)")
    parser.add_argument("--top-k", type=int, default=2, help="experts each token goes to (default: 2)")
    parser.add_argument("--aux-loss-coef", type=float, default=0.01,
                        help="the router's load-balancing loss coefficient in the config (default: 0.01)")
    parser.add_argument("--seed", type=int, default=0, help="the router's initialisation (default: 0)")
    args = parser.parse_args(argv)
    try:
        out = upcycle(args.source, args.target, experts=args.experts, top_k=args.top_k,
                      aux_loss_coef=args.aux_loss_coef, seed=args.seed)
    except ConfigError as err:
        print(f"pipetrain: error: {err}", file=sys.stderr)
        return 2
    print(f"upcycled {args.source} into {out}: {args.experts} experts per layer, top {args.top_k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

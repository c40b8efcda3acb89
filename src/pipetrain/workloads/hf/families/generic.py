"""The generic description: a model type with no description of its own but the common layout.

transformers' causal LM class for the config (`AutoModelForCausalLM`'s mapping) is built on the meta device; when it
holds `model.embed_tokens` (a plain `nn.Embedding`), `model.layers`, `model.norm`, `model.rotary_emb` and `lm_head`
(an `nn.Linear` without bias), the description names the classes found there (the decoder layer is
`type(model.layers[0])`), reads the norm's epsilon field and initial value (as its constructor sets it), picks each
layer's mask as transformers does (`transformers_mask`: `config.layer_types`, else `config.sliding_window`) and
translates the config's own `base_model_tp_plan` into torch's styles. What such a model does beyond its layers (a
scaled embedding or logits, a soft cap) is taken from the list of what transformers' classes do there (`outside.py`);
a flag of that list that no pipetrain block applies is refused by `family_of`, and the proof that the blocks compute
what transformers' class computes (`pipetrain.workloads.hf.proof`) runs when a model is built from a folder. The
adapter says in one line that the generic description is used; a class without that layout is refused naming the
parts that are missing, and a mixture of experts without a description (`moe.py` describes six) up front
(`refuse_mixture_of_experts`, naming what a description says). The line is said once
per job: by the process that starts the local ranks, or by rank 0 of a launcher (`speaks`).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from pipetrain.compat.tensor_styles import heads_replicated
from pipetrain.errors import ConfigError, PipetrainError
from pipetrain.launch.env import detect
from pipetrain.launch.spawn import spawned_rank
from pipetrain.parallel.tensor import TPPlan
from pipetrain.workloads.hf.families.family import (Family, causal_lm_class, require_transformers, tp_divides,
                                                    transformers_mask)
from pipetrain.workloads.hf.families.outside import generic_fields

__all__ = ["COMMON_LAYOUT", "EXPERT_COUNTS", "generic_family", "refuse_mixture_of_experts", "speaks"]

log = logging.getLogger("pipetrain")

#: the parts of the common layout (transformers' Llama-derived models): role -> attribute path
COMMON_LAYOUT = {"embedding": "model.embed_tokens", "layers": "model.layers", "final norm": "model.norm",
                 "rotary tables": "model.rotary_emb", "head": "lm_head"}
_EPS_FIELDS = ("rms_norm_eps", "layer_norm_eps", "norm_eps", "norm_epsilon", "layer_norm_epsilon")
#: transformers' TP style names -> torch's styles (a module on this rank's heads for "replicated_with_grad_allreduce")
_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
           "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
           "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
           "replicated_with_grad_allreduce": heads_replicated}
_BUILT: dict[str, Family] = {}
#: the config fields that count a mixture of experts' routed experts (transformers' names across its MoE classes)
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def _dotted(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _get(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def refuse_mixture_of_experts(config: Any) -> None:
    """One ConfigError for a mixture-of-experts config without a description (a positive expert count, unless it
    says `is_moe=False`): the generic description would build its layers without the router's statistics and
    loss, so it names what a description of it says (`families/moe.py`)."""
    counts = {name: getattr(config, name) for name in EXPERT_COUNTS if isinstance(getattr(config, name, None), int)}
    experts = {name: count for name, count in counts.items() if count > 0}
    if experts and getattr(config, "is_moe", True) is not False:
        name, count = next(iter(experts.items()))
        raise ConfigError(f"Hugging Face model type {config.model_type!r}: a mixture of experts ({name}={count}) with "
                          "no description in pipetrain: its description names the decoder layer, norm and rotary "
                          f"classes, the experts' count field ({name}), whether its causal LM adds the "
                          "load-balancing loss, and any router balancing bias",
                          hint="describe it in pipetrain/workloads/hf/families/moe.py as MIXTRAL is (docs/moe.md); "
                               "described mixtures: qwen3_moe, qwen2_moe, mixtral, olmoe, deepseek_v3, gpt_oss")


def _misfit(config: Any, model: nn.Module) -> list[str]:
    """What of the common layout `model` lacks or holds differently, one phrase each."""
    found = {role: _get(model, path) for role, path in COMMON_LAYOUT.items()}
    wrong = [f"no {path} ({role})" for role, path in COMMON_LAYOUT.items() if found[role] is None]
    embedding, head, layers = found["embedding"], found["head"], found["layers"]
    if embedding is not None and type(embedding) is not nn.Embedding:
        wrong.append(f"model.embed_tokens is a {type(embedding).__name__}, not an nn.Embedding (a scaled embedding?)")
    if head is not None and (type(head) is not nn.Linear or head.bias is not None):
        biased = " with a bias" if getattr(head, "bias", None) is not None else ""
        wrong.append(f"lm_head is a {type(head).__name__}{biased}, not an nn.Linear without bias")
    if layers is not None and (not isinstance(layers, nn.ModuleList) or len(layers) != config.num_hidden_layers):
        wrong.append("model.layers is not a ModuleList of num_hidden_layers decoder layers")
    norm = found["final norm"]
    if norm is not None and not any(isinstance(getattr(config, f, None), float) for f in _EPS_FIELDS):
        wrong.append(f"no epsilon field for the final norm in the config (one of {', '.join(_EPS_FIELDS)})")
    elif norm is not None and _norm_init(config, norm) is None:
        wrong.append(f"model.norm is a {type(norm).__name__}, not built as cls(hidden_size, eps=...) with a weight")
    return wrong


def _norm_init(config: Any, norm: nn.Module) -> float | None:
    """The initial value of the final norm's weight as its class builds it, or None when it is not built so."""
    eps = next(f for f in _EPS_FIELDS if isinstance(getattr(config, f, None), float))
    try:
        weight = type(norm)(config.hidden_size, eps=getattr(config, eps)).weight
    except (TypeError, AttributeError):
        return None
    return None if weight is None else weight.flatten()[0].item()


def _tp_plan(config: Any, tp: int) -> TPPlan:
    """The decoder layer's plan: transformers' own `base_model_tp_plan` of `config`, as torch's styles."""
    styles = dict(getattr(config, "base_model_tp_plan", None) or {})
    prefix = "layers.*."
    with torch.device("meta"):
        family = generic_family(config)
        layer = family.resolve(family.layer_class)(config, 0)
    head_dim = getattr(getattr(layer, "self_attn", None), "head_dim", None)

    def fits(key: str, style: str) -> bool:  # a whole weight on the rank's heads: only a norm over head_dim
        if style != "replicated_with_grad_allreduce":
            return style in _STYLES
        weight = getattr(_get(layer, key[len(prefix):]) if key.startswith(prefix) else None, "weight", None)
        return weight is not None and head_dim is not None and weight.numel() == head_dim

    unknown = sorted({f"{style!r} ({key})" for key, style in styles.items() if not fits(key, style)})
    if not styles or unknown or any(not key.startswith(prefix) for key in styles):
        raise ConfigError(f"the generic description of {config.model_type!r} cannot split its layers: "
                          + (f"transformers' TP plan for it uses {', '.join(unknown)}, which pipetrain does not "
                             "translate" if unknown else "transformers gives it no decoder-layer TP plan"),
                          hint="run it with --tp 1")
    tp_divides(tp, {name: getattr(config, name) for name in ("num_attention_heads", "num_key_value_heads",
                                                             "intermediate_size")
                    if isinstance(getattr(config, name, None), int)})
    return {f"layer.{key[len(prefix):]}": _STYLES[style]() for key, style in styles.items()}


def speaks() -> bool:
    """Whether this process says the job's one line: the process that starts local ranks (not the ranks it
    spawned, which have joined their group when they build the model), or rank 0 of a launcher (torchrun, Slurm)."""
    if spawned_rank() is not None:  # a local rank: the process that started it has spoken
        return False
    try:
        placed = detect()
    except PipetrainError:
        placed = None
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return placed is not None and torch.distributed.get_rank() == 0
    return placed is None or placed.rank == 0


def generic_family(config: Any) -> Family:
    """The generic description of `config`'s model type (built once per process, said in one log line) with what its
    transformers class does outside the layers (`outside.generic_fields`), or one ConfigError: a mixture of experts,
    or what of the common layout its transformers class lacks."""
    refuse_mixture_of_experts(config)
    name = config.model_type
    if name not in _BUILT:
        _BUILT[name] = _described(config)
    return replace(_BUILT[name], **generic_fields(config))


def _described(config: Any) -> Family:
    name = config.model_type
    cls = causal_lm_class(config)
    logging_ = require_transformers().utils.logging
    verbosity = logging_.get_verbosity()
    logging_.set_verbosity_error()  # its advice for the class's own uses (BERT's "add is_decoder=True") is noise here
    try:
        with torch.device("meta"):
            model = cls(copy.deepcopy(config))
    except Exception as err:  # transformers' own check of the config, whatever it raises
        raise ConfigError(f"transformers cannot build {cls.__name__} from this {name!r} config: "
                          f"{type(err).__name__}: {err}", hint="pass a config that from_pretrained loads") from None
    finally:
        logging_.set_verbosity(verbosity)
    wrong = _misfit(config, model)
    if wrong:
        raise ConfigError(f"Hugging Face model type {name!r} is not supported: it has no description in pipetrain and "
                          f"{cls.__name__} does not have the common layout: {'; '.join(wrong)}",
                          hint="describe the family (a Family in pipetrain/workloads/hf/families/, see docs/models.md)")
    norm = model.get_submodule(COMMON_LAYOUT["final norm"])
    eps = next(f for f in _EPS_FIELDS if isinstance(getattr(config, f, None), float))
    family = Family(
        name=name, embed=COMMON_LAYOUT["embedding"], layers=COMMON_LAYOUT["layers"], norm=COMMON_LAYOUT["final norm"],
        layer_class=_dotted(type(model.get_submodule("model.layers.0"))), norm_class=_dotted(type(norm)),
        norm_eps=eps, rotary_class=_dotted(type(model.get_submodule(COMMON_LAYOUT["rotary tables"]))),
        position_ids=True, norm_init=_norm_init(config, norm), tp_plan=_tp_plan, mask=transformers_mask,
        embed_padding=model.get_submodule(COMMON_LAYOUT["embedding"]).padding_idx is not None,
    )
    if speaks():
        log.warning("model type %r has no description of its own: pipetrain uses the generic one (%s's %s, %s, %s), "
                    "proven against transformers' class on a tiny copy of each config; `pipetrain check` proves that "
                    "a layout trains the same as unsplit, `pipetrain check --against transformers` the full-size "
                    "logits", name, cls.__name__, type(model.get_submodule("model.layers.0")).__name__,
                    type(norm).__name__, type(model.get_submodule(COMMON_LAYOUT["rotary tables"])).__name__)
    return family

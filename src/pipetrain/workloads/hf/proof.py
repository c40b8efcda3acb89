"""The proof that pipetrain's blocks compute what transformers' class computes, on a tiny copy of a model's config.

`prove(config)` makes a tiny random copy of `config` (2 decoder layers, hidden 64, 4 query and 2 key/value heads of
16, a vocabulary of 128, windows of 4 tokens, experts 32 wide: every other field and flag as the config has it,
each layer type kept, a dense and an expert layer of a mixture with both),
builds it as transformers' `AutoModelForCausalLM` with random weights, and as pipetrain's blocks in order loaded with
those weights, and compares their logits on 16 random tokens: they agree within fp32 round-off (`ROUND_OFF` of the
largest logit), in well under a second on CPU. The weights are drawn at unit scale (not at transformers' 0.02) so
that the logits are large enough for a soft cap, a scale or a divisor to show. A disagreement refuses the config with
one line naming the family and the largest difference; for a described family that is a pipetrain bug and the line
says so. Each config is proven once per process (cached by its hash, with the description) and by the process that
says the job's lines (`speaks`), not by every rank. `logit_difference` compares two models' logits; `pipetrain check
--against transformers` uses it on the real folder at full size.
"""

from __future__ import annotations

import copy
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipetrain.blocks import as_tuple
from pipetrain.errors import ConfigError
from pipetrain.workloads.hf.blocks import DecoderLayer, Embedding, Head
from pipetrain.workloads.hf.families import FAMILIES, family_of, require_transformers
from pipetrain.workloads.hf.families.family import default_attention
from pipetrain.workloads.hf.families.generic import speaks

__all__ = ["Proof", "ROUND_OFF", "TINY", "tiny_copy", "compare", "prove", "logit_difference"]

log = logging.getLogger("pipetrain")

#: the tiny copy's sizes (set where the config has the field; vocabulary, heads, experts' widths and windows shrunk)
TINY = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, "sliding_window": 4,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64}
#: latent attention's widths (DeepSeek's): its rotary part is `head_dim`, set to match
LATENT = {"q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16}
SEQ = 16
#: logits agree when their largest difference is at most this fraction of the largest logit (at least 1)
ROUND_OFF = 1e-5
_PROVEN: dict[str, Proof] = {}


@dataclass(frozen=True)
class Proof:
    """The comparison of one config's tiny copy: transformers' logits against pipetrain's blocks'."""

    family: str  #: the model type
    described: bool  #: whether pipetrain has a description of its own for it (else the generic one)
    difference: float  #: the largest |ours - transformers'| over the logits
    largest: float  #: the largest |transformers' logit|

    @property
    def holds(self) -> bool:
        """Whether the logits agree within fp32 round-off."""
        return self.difference <= ROUND_OFF * max(1.0, self.largest)

    def line(self) -> str:
        """One line saying the result."""
        return (f"{self.family}: largest logit difference {self.difference:.3g} against transformers' class "
                f"(largest logit {self.largest:.3g}; round-off bound {ROUND_OFF * max(1.0, self.largest):.3g})")


def _layer_types(types: list[str]) -> list[str]:
    """Two layer types that keep each kind the config has (the first, then another kind if there is one)."""
    other = next((kind for kind in types if kind != types[0]), types[0])
    return [types[0], other]


def _shrink(tiny: Any, sizes: dict[str, int]) -> None:
    for name, value in sizes.items():
        if isinstance(getattr(tiny, name, None), int) and not isinstance(getattr(tiny, name), bool):
            setattr(tiny, name, value)


def _dense_then_experts(tiny: Any) -> None:
    """Of a mixture with dense layers, the copy's first layer dense and its second an expert layer."""
    if isinstance(getattr(tiny, "first_k_dense_replace", None), int) and tiny.first_k_dense_replace > 1:
        tiny.first_k_dense_replace = 1
    if isinstance(getattr(tiny, "mlp_only_layers", None), list) and tiny.mlp_only_layers:
        tiny.mlp_only_layers = [0]
    if isinstance(getattr(tiny, "decoder_sparse_step", None), int) and tiny.decoder_sparse_step > 2:
        tiny.decoder_sparse_step = 2


def tiny_copy(config: Any) -> Any:
    """A copy of `config` with `TINY`'s sizes where it has those fields (and `LATENT`'s), one layer of each kind it
    has (attention types; dense and expert layers), its other fields and flags unchanged."""
    tiny = copy.deepcopy(config)
    _shrink(tiny, TINY)
    if isinstance(getattr(tiny, "qk_rope_head_dim", None), int):  # latent attention: head_dim is the rotary part
        _shrink(tiny, LATENT)
        tiny.head_dim = tiny.qk_rope_head_dim
        if hasattr(tiny, "qk_head_dim"):
            tiny.qk_head_dim = tiny.qk_nope_head_dim + tiny.qk_rope_head_dim
    _dense_then_experts(tiny)
    types = getattr(config, "layer_types", None)
    if isinstance(types, list) and types:
        tiny.layer_types = _layer_types(types)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):  # ids inside the tiny vocabulary
        if isinstance(getattr(tiny, name, None), int) and getattr(tiny, name) >= tiny.vocab_size:
            setattr(tiny, name, tiny.vocab_size - 1)
    if getattr(tiny, "_attn_implementation", None) is None:
        tiny._attn_implementation = default_attention(tiny)
    return tiny


def _randomized(model: nn.Module, seed: int) -> None:
    """Unit-scale random weights: matrices normal(0, 1/fan_in), the embedding and head normal(0, 1), vectors (norms,
    biases) their initial value plus normal(0, 0.1): logits of a few units, where scales and caps show."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            for name, param in module.named_parameters(recurse=False):
                noise = torch.randn(param.shape, generator=generator, dtype=param.dtype)
                if param.dim() >= 2 and isinstance(module, nn.Embedding | nn.Linear) and \
                        param.shape[0] == model.config.vocab_size:
                    param.copy_(noise)
                elif param.dim() >= 2:
                    param.copy_(noise / param.shape[-1] ** 0.5)
                else:
                    param.add_(0.1 * noise)


def _blocks(config: Any, state: dict[str, torch.Tensor]) -> list[nn.Module]:
    """pipetrain's blocks of `config` in order, loaded from transformers' `state` (same names)."""
    family = family_of(config)
    blocks = [Embedding(config, family), *(DecoderLayer(config, family, i) for i in range(config.num_hidden_layers)),
              Head(config, family)]
    embedding = f"{family.embed}.weight"
    with torch.no_grad():
        for block in blocks:
            own = block.state_dict()
            for local, key in block.checkpoint_keys():
                own[local].copy_(state[key] if key in state else state[embedding])  # a tied head: the embedding
    return [block.eval() for block in blocks]


def logit_difference(reference: Callable[[torch.Tensor], torch.Tensor], blocks: list[nn.Module],
                     ids: torch.Tensor) -> tuple[float, float]:
    """(largest |ours - theirs|, largest |theirs|) of `reference(ids)` (transformers' logits) and `blocks` in order."""
    with torch.no_grad():
        theirs = reference(ids).float()
        hidden = ids
        for block in blocks:
            hidden = block(*as_tuple(hidden))
        logits = hidden[0] if isinstance(hidden, tuple) else hidden  # a mixture of experts: (logits, aux)
        return (logits.float() - theirs).abs().max().item(), theirs.abs().max().item()


def compare(config: Any, *, seed: int = 0) -> Proof:
    """Build `config`'s tiny copy as transformers' class and as pipetrain's blocks, same weights; compare logits."""
    transformers = require_transformers()
    tiny = tiny_copy(config)
    verbosity = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.set_verbosity_error()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            reference = transformers.AutoModelForCausalLM.from_config(tiny).eval()
    finally:
        transformers.utils.logging.set_verbosity(verbosity)
    _randomized(reference, seed)
    blocks = _blocks(tiny, reference.state_dict())
    ids = torch.randint(0, tiny.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(seed))
    difference, largest = logit_difference(lambda x: reference(input_ids=x).logits, blocks, ids)
    return Proof(config.model_type, config.model_type in FAMILIES, difference, largest)


def _key(config: Any) -> str:
    """The config's hash, with the description pipetrain builds it by (a description changed in-process is new)."""
    text = config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else repr(config)
    return hashlib.sha256(f"{type(config).__name__}:{text}:{family_of(config)!r}".encode()).hexdigest()


def prove(config: Any, *, always: bool = False) -> Proof | None:
    """Prove `config` once per process (by the process that speaks for the job, or every process with `always`):
    the `Proof`, or one ConfigError naming the family and the largest difference; None where this process does
    not prove. A config transformers cannot build small is said in one line and not refused."""
    key = _key(config)
    if key in _PROVEN:
        return _PROVEN[key]
    if not (always or speaks()):
        return None
    try:
        proof = compare(config)
    except ConfigError:
        raise
    except Exception as err:  # transformers' own check of the tiny copy (a size the copy changed)
        log.warning("%s: the tiny copy of its config could not be built (%s: %s), so its blocks were not proven "
                    "against transformers' class; `pipetrain check --against transformers` compares the full model",
                    config.model_type, type(err).__name__, err)
        return None
    if not proof.holds:
        bug = (" — a described family that disagrees is a pipetrain bug: please report it" if proof.described
               else " (the generic description misses something its class computes)")
        raise ConfigError(f"Hugging Face model type {proof.family!r}: pipetrain's blocks do not compute what "
                          f"transformers' class computes: {proof.line()}{bug}",
                          hint="pass a folder of a described family (docs/models.md), or describe this one")
    _PROVEN[key] = proof
    return proof

"""The blocks at both ends of a Hugging Face causal LM, and the base of every block: the embedding (tokens, positions,
scaled; the router statistics started at zero) and the head (final norm, LM head, the family's logit arithmetic;
the load-balancing loss). A block's parameters keep the transformers model's names through `prefixes`."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from pipetrain.moe.router import load_balancing_loss, sum_over_ranks
from pipetrain.workloads.hf.families import Family
from pipetrain.workloads.hf.routing import carries_router_statistics, num_experts

__all__ = ["HFBlock", "Embedding", "Head"]


class HFBlock(nn.Module):
    """A block whose parameters map to checkpoint keys by prefix (local prefix -> checkpoint prefix)."""

    prefixes: dict[str, str]

    def checkpoint_keys(self) -> Iterator[tuple[str, str]]:
        """(local name, checkpoint key) of every parameter and persistent buffer."""
        for name in self.state_dict():
            local = next(p for p in self.prefixes if name.startswith(p))
            yield name, self.prefixes[local] + name[len(local):]


def _leaf(path: str) -> str:
    return path.rpartition(".")[2]


class Embedding(HFBlock):
    """Token embedding (named as in the transformers model: `embed_tokens`, `wte`), scaled, plus positions."""

    def __init__(self, config: Any, family: Family) -> None:
        super().__init__()
        self.tokens, self.positions = _leaf(family.embed), family.position and _leaf(family.position)
        padding = config.pad_token_id if family.embed_padding else None
        self.add_module(self.tokens, nn.Embedding(config.vocab_size, config.hidden_size, padding))
        self.prefixes = {f"{self.tokens}.": f"{family.embed}."}
        if family.position is not None:
            self.add_module(self.positions, nn.Embedding(config.max_position_embeddings, config.hidden_size))
            self.prefixes[f"{self.positions}."] = f"{family.position}."
        self.drop = nn.Dropout(getattr(config, family.embed_dropout)) if family.embed_dropout else nn.Identity()
        self.scale = math.sqrt(config.hidden_size) if family.embed_scale else None
        self.multiplier = getattr(config, family.embed_multiplier) if family.embed_multiplier else None
        self.experts = num_experts(config, family) if carries_router_statistics(config, family) else 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> Any:
        """The hidden states; with per-token `positions` (packed documents), `(hidden states, positions)`; with the
        load-balancing loss on, the router statistics (zero) after them."""
        at = torch.arange(input_ids.shape[1], device=input_ids.device)[None] if positions is None else positions
        out = (self.embed(input_ids, at),) + (() if positions is None else (positions,))
        if self.experts:
            out += (torch.zeros(input_ids.shape[0], 2, self.experts, device=input_ids.device),)
        return out[0] if len(out) == 1 else out

    def embed(self, input_ids: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """The hidden states of `input_ids` at positions `at`: the token embedding, scaled and multiplied as the
        family says, plus the position embedding where there is one, then the dropout."""
        hidden = self.get_submodule(self.tokens)(input_ids)
        if self.scale is not None:  # in the embedding's dtype, as transformers does
            hidden = hidden * torch.tensor(self.scale, dtype=hidden.dtype)
        if self.multiplier is not None:  # a Python float, as transformers multiplies (Granite)
            hidden = hidden * self.multiplier
        if self.positions:
            hidden = hidden + self.get_submodule(self.positions)(at)
        return self.drop(hidden)


class Head(HFBlock):
    """The final norm (`norm`) and the output projection (`lm_head`), then the family's logit multiplier, divisor and
    soft cap (each a value of the config, or None), in the order and the arithmetic of the transformers class."""

    def __init__(self, config: Any, family: Family) -> None:
        super().__init__()
        self.norm = family.resolve(family.norm_class)(config.hidden_size, eps=getattr(config, family.norm_eps))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.prefixes = {"norm.": f"{family.norm}.", "lm_head.": f"{family.head}."}
        self.multiplier, self.divisor, self.softcap = (
            None if field is None else getattr(config, field)
            for field in (family.logit_multiplier, family.logit_divisor, family.logit_softcap))

        self.carries = carries_router_statistics(config, family)
        self.top_k = getattr(config, "num_experts_per_tok", 0)
        self.context_group: Any = None  #: the cp group whose ranks hold the other parts of the sequences

    def use_context(self, context: Any) -> None:
        """Context parallelism: the router statistics of a micro-batch are summed over the cp group (`context.group`)
        before the load-balancing loss, which is then the whole sequences' (`pipetrain.moe.router.sum_over_ranks`)."""
        self.context_group = context.group

    def forward(self, hidden: torch.Tensor, *extra: torch.Tensor) -> Any:
        """The logits (the positions of packed documents end here); with the router statistics, `(logits, aux)`:
        the micro-batch's load-balancing loss, one copy per sample (`pipetrain.moe.router.RouterAuxLoss`)."""
        logits = self.logits(hidden)
        if not self.carries:
            return logits
        aux = load_balancing_loss(sum_over_ranks(extra[-1], self.context_group), self.top_k)
        return logits, aux.expand(hidden.shape[0]).contiguous()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of `hidden`: normed, projected, then multiplied, divided and soft-capped as the family says."""
        logits = self.lm_head(self.norm(hidden))
        if self.multiplier is not None:  # Cohere
            logits = logits * self.multiplier
        if self.divisor is not None:  # Granite
            logits = logits / self.divisor
        if self.softcap is not None:  # Gemma 2 and 3
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

"""Context-parallel attention as a transformers attention function: the group, the mask of a split sequence, and
the registration through transformers' own `AttentionInterface`.

A decoder layer of a context-parallel stage passes a `ContextMask` as its `attention_mask` and runs with
`attn_implementation` "pipetrain_context" (`ContextParallel.attach`), so transformers' decoder layers run unchanged:
their attention module computes q, k, v and rotary embeddings on the rank's tokens (positions continue across the
parts) and calls `context_attention`, which runs ring or all-to-all attention over the whole sequence. The mask is
built from each token's global index (the zig-zag layout) and its position: a token's document starts at
index - position, so packed documents (positions restarting per document) stay apart across ranks.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.config import CP_ATTENTIONS
from pipetrain.context.blocks import KERNELS
from pipetrain.context.layout import zigzag_index
from pipetrain.context.ring import EXCHANGES, ring_attention
from pipetrain.context.ulysses import check_heads, ulysses_attention
from pipetrain.errors import ConfigError

__all__ = ["ATTENTION_NAME", "CP_ATTENTIONS", "ContextMask", "ContextParallel", "context_attention"]

#: the name the attention function is registered under in transformers' `AttentionInterface`
ATTENTION_NAME = "pipetrain_context"


@dataclass(frozen=True)
class ContextMask:
    """What attention needs to know of a split sequence: the group, this rank, the mode, and the global index and
    document start of every token of every rank (`index` [N, L]; `starts` [N, B, L] or None without documents).
    `window`: a sliding window (keys at most `window - 1` tokens back), or None. `exchange`: how the ring passes its
    blocks (`ring.EXCHANGES`: overlapped with the attention by default). `kernel`: the ring's block attention
    (`blocks.KERNELS`: torch's fused kernel by default, torch ops where it cannot run)."""

    group: Any
    rank: int
    size: int
    mode: str
    index: torch.Tensor
    starts: torch.Tensor | None
    window: int | None = None
    exchange: str = "overlap"
    kernel: str = "fused"

    def _allowed(self, q_rank: int, q_part: slice, k_rank: int, k_part: slice) -> torch.Tensor:
        iq, ik = self.index[q_rank, q_part], self.index[k_rank, k_part]
        allowed = (ik[None, :] <= iq[:, None])[None]
        if self.window is not None:
            allowed = allowed & (iq[:, None] - ik[None, :] < self.window)[None]
        if self.starts is not None:
            allowed = allowed & (self.starts[q_rank, :, q_part, None] == self.starts[k_rank, :, None, k_part])
        return allowed[:, None]  # [B or 1, 1, Lq, Lk]

    def block_mask(self, source: int, a: int, b: int) -> torch.Tensor | bool:
        """The mask of this rank's query part `a` (0: front, 1: back) against rank `source`'s key part `b`: False
        when wholly masked (skipped), True when wholly visible, else a boolean tensor."""
        half = self.index.shape[1] // 2
        q_first, k_first = int(self.index[self.rank, a * half]), int(self.index[source, b * half])
        if k_first > q_first:
            return False  # the key part lies after the query part: causal
        if k_first < q_first and self.starts is None and self.window is None:
            return True
        mask = self._allowed(self.rank, slice(a * half, (a + 1) * half), source, slice(b * half, (b + 1) * half))
        return False if not bool(mask.any()) else True if bool(mask.all()) else mask

    def sequence_mask(self) -> torch.Tensor:
        """The mask of the whole sequence in the ranks' order (all-to-all attention), [B or 1, 1, N*L, N*L]."""
        index = self.index.reshape(-1)
        allowed = (index[None, :] <= index[:, None])[None]
        if self.window is not None:
            allowed = allowed & (index[:, None] - index[None, :] < self.window)[None]
        if self.starts is not None:
            starts = self.starts.permute(1, 0, 2).reshape(self.starts.shape[1], -1)
            allowed = allowed & (starts[:, :, None] == starts[:, None, :])
        return allowed[:, None]


class ContextParallel:
    """The context-parallel group of a stage's ranks and its attention (`mode`: "ring" or "ulysses").

    `exchange` (class default "overlap"): how the ring passes its blocks, one of `ring.EXCHANGES`; "sync" and
    "local" are for measuring the overlap. `kernel` (class default "fused"): the ring's block attention, one of
    `blocks.KERNELS`; "ops" is for measuring (benchmarks/context_parallel.py sets the class attributes in its ranks)."""

    exchange = "overlap"
    kernel = "fused"

    def __init__(self, group: Any, mode: str = "ring", *, tp: int = 1) -> None:
        if mode not in CP_ATTENTIONS:
            raise ConfigError(f"unknown --cp-attention {mode!r}", hint=f"choose one of: {', '.join(CP_ATTENTIONS)}")
        if self.exchange not in EXCHANGES:
            raise ConfigError(f"unknown ring exchange {self.exchange!r}", hint=f"choose one of: {', '.join(EXCHANGES)}")
        if self.kernel not in KERNELS:
            raise ConfigError(f"unknown ring kernel {self.kernel!r}", hint=f"choose one of: {', '.join(KERNELS)}")
        self.group, self.mode, self.tp = group, mode, tp
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def after(self, split: Callable[[int, nn.Module], nn.Module] | None) -> Callable[[int, nn.Module], nn.Module]:
        """The engine's `split_block` hook: `split` (tensor parallelism's, or None) first, then `attach`. Under tp
        each tp rank holds its own heads, and the ring or all-to-all runs over them with the cp ranks of the same
        tp rank: both split the attention, tp by heads and cp by tokens, so they compose. The hook keeps `split`'s
        `sequence_shards` (sequence parallelism cuts the cp part again between the TP regions) and `loss_parallel`
        (the logits of the cp part split over the vocabulary)."""
        return _Attached(self, split)

    def attach(self, index: int, block: nn.Module) -> nn.Module:
        """`block` with its attention run by this group (blocks without attention, `use_context`, unchanged);
        the engine's `split_block` hook."""
        use = getattr(block, "use_context", None)
        if use is not None:
            register()
            use(self)
        return block

    def check_config(self, config: Any) -> None:
        """Raise if a transformers config's heads (a tp rank's share of them) do not split for all-to-all attention."""
        if self.mode == "ulysses":
            heads = config.num_attention_heads
            check_heads(heads, getattr(config, "num_key_value_heads", None) or heads, self.size, self.tp)

    def whole_sequences(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's part `[B, L / cp, ...]` of a micro-batch's sequences gathered from every rank into the whole
        sequences `[B, L, ...]`, in token order (a collective over the group, not differentiable)."""
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        length = local.shape[1] * self.size
        whole = local.new_empty(local.shape[0], length, *local.shape[2:])
        for rank, part in enumerate(parts):
            whole[:, zigzag_index(length, self.size, rank, local.device)] = part
        return whole

    def own_part(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part `[B, L / cp, ...]` of whole sequences `[B, L, ...]`."""
        return whole[:, zigzag_index(whole.shape[1], self.size, self.rank, whole.device)]

    def mask(self, hidden: torch.Tensor, positions: torch.Tensor) -> ContextMask:
        """The `ContextMask` of this micro-batch: this rank's `positions` [B, L] gathered from every rank."""
        length = hidden.shape[1]
        index = torch.stack([zigzag_index(length * self.size, self.size, r) for r in range(self.size)])
        if hidden.device.type == "meta":
            return ContextMask(self.group, self.rank, self.size, self.mode, index, None, exchange=self.exchange,
                               kernel=self.kernel)
        gathered = [torch.empty_like(positions) for _ in range(self.size)]
        dist.all_gather(gathered, positions.contiguous(), group=self.group)
        index = index.to(positions.device)
        starts = torch.stack([index[r][None] - gathered[r] for r in range(self.size)])  # [N, B, L]
        return ContextMask(self.group, self.rank, self.size, self.mode, index,
                           starts if bool(starts.any()) else None, exchange=self.exchange, kernel=self.kernel)


@dataclass(frozen=True)
class _Attached:
    """`split` (or nothing) then the context's `attach`, with `split`'s engine-facing attributes."""

    context: ContextParallel
    split: Callable[[int, nn.Module], nn.Module] | None

    def __call__(self, index: int, block: nn.Module) -> nn.Module:
        return self.context.attach(index, block if self.split is None else self.split(index, block))

    @property
    def sequence_shards(self) -> int:
        return getattr(self.split, "sequence_shards", 1)

    @property
    def loss_parallel(self) -> bool:
        return getattr(self.split, "loss_parallel", False)


def context_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; a `ContextMask` runs ring or all-to-all attention, any other
    mask transformers' sdpa attention."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not isinstance(attention_mask, ContextMask):
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    if dropout:
        raise ConfigError(f"context parallelism with attention dropout {dropout}: the ring and all-to-all attention "
                          "have no dropout", hint="set the model's attention dropout to 0")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if kwargs.get("sliding_window") and attention_mask.window is None:  # the layer's window (Mistral, Qwen2)
        attention_mask = replace(attention_mask, window=int(kwargs["sliding_window"]))
    if query.device.type == "meta":
        return torch.empty_like(query).transpose(1, 2), None
    attend = ring_attention if attention_mask.mode == "ring" else ulysses_attention
    return attend(query, key, value, attention_mask, scale), None


def register() -> None:
    """Register `context_attention` as `attn_implementation="pipetrain_context"` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, context_attention)


def context_config(config: Any) -> Any:
    """A shallow copy of a transformers config whose attention is `context_attention`."""
    config = copy.copy(config)
    config._attn_implementation = ATTENTION_NAME
    return config

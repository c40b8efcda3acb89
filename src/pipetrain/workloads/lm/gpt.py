"""A GPT-style causal decoder written as a `BlockModel` whose blocks pass (hidden states, padding mask).

Blocks, in order: the embedding (token ids `[batch, seq]` -> learned token + position embeddings, and the
boolean mask of non-padding tokens), `nlayers` pre-norm decoder layers (causal self-attention that also
skips padding keys, then a GELU MLP), and the head (final LayerNorm and a linear layer to next-token
logits `[batch, seq, vocab]`). The mask crosses every stage boundary with the hidden states: a
two-tensor pipeline, as the decoders of real language models are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipetrain.blocks import tp_plan_hook
from pipetrain.errors import ConfigError
from pipetrain.workloads.layered import LayeredModel
from pipetrain.workloads.lm.presets import GPT_PRESETS, GPTConfig
from pipetrain.workloads.lm.tp import gpt_tp_plan

__all__ = ["GPTConfig", "GPT_PRESETS", "GPTModel", "GPTEmbedding", "DecoderLayer", "GPTHead", "PAD_ID"]

#: The padding token id of the inputs (and of the corpus): the mask is `tokens != PAD_ID`.
PAD_ID = 0


class GPTEmbedding(nn.Module):
    """Token ids `[batch, seq]` -> (hidden `[batch, seq, emsize]`, non-padding mask `[batch, seq]` bool)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(config.vocab_size, config.emsize)
        self.positions = nn.Embedding(config.seq_len, config.emsize)
        self.dropout = nn.Dropout(config.dropout)
        nn.init.normal_(self.tokens.weight, std=0.02)
        nn.init.normal_(self.positions.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        length = tokens.shape[1]
        if length > self.positions.num_embeddings:
            raise ConfigError(f"input has {length} tokens per sample but the model was built for "
                              f"seq_len={self.positions.num_embeddings}", hint="cut the sequences to the model's seq_len")
        positions = torch.arange(length, device=tokens.device)
        hidden = self.dropout(self.tokens(tokens) + self.positions(positions))
        return hidden, tokens != PAD_ID


class DecoderLayer(nn.Module):
    """(hidden, mask) -> (hidden, mask): pre-norm causal self-attention over non-padding keys, then an MLP."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.nhead = config.nhead
        self.head_dim = config.emsize // config.nhead
        self.dropout = config.dropout
        self.causal_flag = config.causal_flag
        self.norm1 = nn.LayerNorm(config.emsize)
        self.qkv = nn.Linear(config.emsize, 3 * config.emsize)
        self.proj = nn.Linear(config.emsize, config.emsize)
        self.norm2 = nn.LayerNorm(config.emsize)
        self.mlp = nn.Sequential(
            nn.Linear(config.emsize, config.mlp_ratio * config.emsize),
            nn.GELU(),
            nn.Linear(config.mlp_ratio * config.emsize, config.emsize),
            nn.Dropout(config.dropout),
        )

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # heads from the projection's width: all of them, or this rank's under tensor parallelism (gpt_tp); the
        # length from its output too (the hidden states are this rank's sequence shard under sequence parallelism)
        qkv = self.qkv(self.norm1(hidden))
        batch, length = qkv.shape[:2]
        q, k, v = qkv.view(batch, length, 3, -1, self.head_dim).unbind(2)
        allowed = None
        if not self.causal_flag:  # a query sees earlier non-padding keys, and always itself (so no row is empty)
            causal = torch.ones(length, length, dtype=torch.bool, device=hidden.device).tril()
            allowed = (causal & mask[:, None, None, :]) | torch.eye(length, dtype=torch.bool, device=hidden.device)
        attended = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed, is_causal=allowed is None,
            dropout_p=self.dropout if self.training else 0.0,
        )
        hidden = hidden + self.proj(attended.transpose(1, 2).reshape(batch, length, -1))
        return hidden + self.mlp(self.norm2(hidden)), mask


class GPTHead(nn.Module):
    """(hidden, mask) -> next-token logits `[batch, seq, vocab]` (final LayerNorm, then linear)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(config.emsize)
        self.linear = nn.Linear(config.emsize, config.vocab_size)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.linear(self.norm(hidden))


class GPTModel(LayeredModel):
    """The causal decoder as a `BlockModel`: `nlayers + 2` blocks, token ids in, next-token logits out."""

    config: GPTConfig

    def embedding(self) -> nn.Module:
        return GPTEmbedding(self.config)

    def layer(self) -> nn.Module:
        return DecoderLayer(self.config)

    def head(self) -> nn.Module:
        return GPTHead(self.config)

    @tp_plan_hook(loss_parallel=True)
    def tp_plan(self, index: int, tp: int, *, sequence_parallel: bool = False, loss_parallel: bool = False):
        """Block `index`'s tensor-parallel plan (see `pipetrain.workloads.lm.tp`; `loss_parallel`: the
        vocabulary-parallel head)."""
        return gpt_tp_plan(self.config, index, tp, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)

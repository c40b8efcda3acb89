"""The reference workload's model: a Transformer-encoder classifier written as a `BlockModel`.

Blocks, in order: the embedding block (token embedding scaled by sqrt(emsize) plus a fixed sinusoidal
positional encoding, then dropout), `nlayers` standard `nn.TransformerEncoderLayer`s (batch first,
pre-norm), and the head (final LayerNorm, mean over the sequence, then a linear layer to the class logits). Every block can be built on
its own, so a pipeline rank builds only its stage. Padding tokens are not masked: the head averages
over all `seq_len` positions, which keeps every block a one-tensor-in, one-tensor-out module.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pipetrain.blocks import tp_plan_hook
from pipetrain.errors import ConfigError
from pipetrain.workloads.layered import LayeredModel
from pipetrain.workloads.classifier.presets import PRESETS, TransformerConfig
from pipetrain.workloads.classifier.tp import classifier_tp_plan

__all__ = ["TransformerConfig", "PRESETS", "TransformerClassifier", "EmbeddingBlock", "HeadBlock"]


def sinusoidal_encoding(seq_len: int, emsize: int) -> torch.Tensor:
    """The fixed `[seq_len, emsize]` sine/cosine positional encoding of "Attention Is All You Need"."""
    position = torch.arange(seq_len, dtype=torch.float32).unsqueeze(1)
    frequency = torch.exp(torch.arange(0, emsize, 2, dtype=torch.float32) * (-math.log(10000.0) / emsize))
    encoding = torch.zeros(seq_len, emsize)
    encoding[:, 0::2] = torch.sin(position * frequency)
    encoding[:, 1::2] = torch.cos(position * frequency[: emsize // 2])
    return encoding


class EmbeddingBlock(nn.Module):
    """Token ids `[batch, seq]` -> embeddings `[batch, seq, emsize]` with positions added, then dropout."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.scale = math.sqrt(config.emsize)
        self.embedding = nn.Embedding(config.vocab_size, config.emsize)
        # A constant of the config, not state: kept out of checkpoints, rebuilt with the block.
        self.register_buffer("positions", sinusoidal_encoding(config.seq_len, config.emsize), persistent=False)
        self.dropout = nn.Dropout(config.dropout)
        nn.init.uniform_(self.embedding.weight, -0.1, 0.1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        if length > self.positions.shape[0]:
            raise ConfigError(
                f"input has {length} tokens per sample but the model was built for seq_len={self.positions.shape[0]}",
                hint="encode the data with the model's seq_len",
            )
        hidden = self.embedding(tokens) * self.scale + self.positions[:length]
        return self.dropout(hidden)


class HeadBlock(nn.Module):
    """Hidden states `[batch, seq, emsize]` -> class logits `[batch, num_classes]` (normalised, mean over the sequence)."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(config.emsize)  # the final norm a pre-norm encoder needs
        self.linear = nn.Linear(config.emsize, config.num_classes)
        nn.init.uniform_(self.linear.weight, -0.1, 0.1)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(self.norm(hidden).mean(dim=1))


class TransformerClassifier(LayeredModel):
    """The reference classifier as a `BlockModel`: `nlayers + 2` blocks, LongTensor in, logits out."""

    config: TransformerConfig

    def embedding(self) -> nn.Module:
        return EmbeddingBlock(self.config)

    def layer(self) -> nn.Module:
        # Pre-norm layers: trained from scratch with AdamW at 1e-3 they learn where the post-norm layers of
        # the original tutorial stall at chance for epochs (measured on the synthetic corpus, `cpu` preset).
        config = self.config
        return nn.TransformerEncoderLayer(
            config.emsize, config.nhead, config.nhid, config.dropout, batch_first=True, norm_first=True
        )

    def head(self) -> nn.Module:
        return HeadBlock(self.config)

    @tp_plan_hook(loss_parallel=True)
    def tp_plan(self, index: int, tp: int, *, sequence_parallel: bool = False, loss_parallel: bool = False):
        """Block `index`'s tensor-parallel plan (see `pipetrain.workloads.classifier.tp`)."""
        return classifier_tp_plan(self.config, index, tp, sequence_parallel=sequence_parallel,
                                  loss_parallel=loss_parallel)

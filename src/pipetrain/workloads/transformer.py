"""The reference workload's model: a Transformer-encoder classifier written as a `BlockModel`.

Blocks, in order: the embedding block (token embedding scaled by sqrt(emsize) plus a fixed sinusoidal
positional encoding, then dropout), `nlayers` standard `nn.TransformerEncoderLayer`s (batch first,
pre-norm), and the head (final LayerNorm, mean over the sequence, then a linear layer to the class logits). Every block can be built on
its own, so a pipeline rank builds only its stage. Padding tokens are not masked: the head averages
over all `seq_len` positions, which keeps every block a one-tensor-in, one-tensor-out module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from pipetrain.errors import ConfigError
from pipetrain.workloads.layered import LayeredModel

__all__ = ["TransformerConfig", "PRESETS", "TransformerClassifier", "EmbeddingBlock", "HeadBlock"]


def _positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"transformer {name} must be a positive integer, got {value!r}", hint=f"pass {name} >= 1")


@dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    """Sizes of `TransformerClassifier`; `emsize` must be a multiple of `nhead`."""

    vocab_size: int
    seq_len: int
    emsize: int
    nhead: int
    nhid: int
    nlayers: int
    dropout: float
    num_classes: int = 2

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "emsize", "nhead", "nhid", "nlayers", "num_classes"):
            _positive_int(name, getattr(self, name))
        if self.vocab_size < 2:
            raise ConfigError(
                f"transformer vocab_size must be at least 2 (padding and unknown ids), got {self.vocab_size}",
                hint="pass vocab_size >= 2",
            )
        if self.num_classes < 2:
            raise ConfigError(
                f"transformer num_classes must be at least 2, got {self.num_classes}",
                hint="pass num_classes >= 2",
            )
        if self.emsize % self.nhead:
            raise ConfigError(
                f"transformer emsize={self.emsize} is not divisible by nhead={self.nhead}",
                hint="choose nhead among the divisors of emsize",
            )
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not (
            0.0 <= self.dropout < 1.0
        ):
            raise ConfigError(
                f"transformer dropout must be in [0, 1), got {self.dropout!r}", hint="pass e.g. dropout=0.1"
            )

    @property
    def num_blocks(self) -> int:
        """Embedding block + encoder layers + head block."""
        return self.nlayers + 2


#: Named sizes. `tiny` is for tests. `cpu` makes one batch-64 forward+backward take a few tenths of a
#: second on one CPU core (~0.4 s on the 2-core development machine). `gpu` takes emsize, nhid, nhead,
#: nlayers and dropout from the PyTorch pipeline-parallelism tutorial (Transformer + Pipe) that the seed
#: benchmark derives from; its seq_len (256) and vocab_size (30000, close to the tutorial's WikiText-2
#: vocabulary) are chosen for IMDB reviews (the tutorial used 35-token windows).
PRESETS: dict[str, TransformerConfig] = {
    "tiny": TransformerConfig(
        vocab_size=1000, seq_len=32, emsize=32, nhead=2, nhid=64, nlayers=4, dropout=0.0
    ),
    "cpu": TransformerConfig(
        vocab_size=20000, seq_len=64, emsize=64, nhead=2, nhid=128, nlayers=8, dropout=0.1
    ),
    "gpu": TransformerConfig(
        vocab_size=30000, seq_len=256, emsize=4096, nhead=16, nhid=4096, nlayers=12, dropout=0.2
    ),
}


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

"""The shape shared by the built-in language models: an embedding block, identical layers, a head block."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn

__all__ = ["LayeredModel"]


class LayeredModel(ABC):
    """A `BlockModel` of `config.num_blocks` blocks: 0 the embedding, then the layers, last the head.

    `config` needs `num_blocks` and `seq_len`; the input is token ids `[batch, seq_len]`. Subclasses say how
    each kind of block is built.
    """

    def __init__(self, config: Any) -> None:
        self.config = config

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"

    @property
    def num_blocks(self) -> int:
        return self.config.num_blocks

    def build_block(self, index: int) -> nn.Module:
        """Block `index`: 0 is the embedding, the last is the head, the ones between are the layers."""
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self.num_blocks:
            raise IndexError(f"block index {index!r} is out of range for a model of {self.num_blocks} blocks")
        if index == 0:
            return self.embedding()
        if index == self.num_blocks - 1:
            return self.head()
        return self.layer()

    def attention_shape(self) -> tuple[int, int, int]:
        """(layers, heads, head dimension) of the attention, for MFU (`pipetrain.logs.mfu`); `config` needs
        `emsize` and `nhead`."""
        return self.num_blocks - 2, self.config.nhead, self.config.emsize // self.config.nhead

    def example_input(self, batch_size: int) -> torch.Tensor:
        """All-padding token ids `[batch_size, seq_len]`."""
        return torch.zeros(batch_size, self.config.seq_len, dtype=torch.long)

    @abstractmethod
    def embedding(self) -> nn.Module:
        """A new embedding block (token ids in)."""

    @abstractmethod
    def layer(self) -> nn.Module:
        """A new layer block."""

    @abstractmethod
    def head(self) -> nn.Module:
        """A new head block (the last one, whose output the loss reads)."""

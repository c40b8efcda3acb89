"""One pipeline stage of a Hugging Face causal LM run for generation: its blocks and the key/value cache of its
own layers.

The blocks are the training blocks (`pipetrain.workloads.hf.blocks`: transformers' own embedding, decoder layers,
norm and head), run here the way transformers' `generate` runs the whole model: each decoder layer gets the
stage's `DynamicCache` (transformers' own; a stage fills only its layers' entries), the attention mask built by
transformers' `create_causal_mask` (or the sliding-window one) from the 2-D padding mask and that cache (sized
against this stage's first layer, before the step's keys are added), the position ids of left-padded prompts,
and the rotary tables of those positions. Only the last position's logits are computed, as `generate` does
(`logits_to_keep=1`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pipetrain.workloads.hf.blocks import DecoderLayer, Embedding, Head
from pipetrain.workloads.hf.families import require_transformers

__all__ = ["GenerationStage"]


def _sliding(config: Any, index: int) -> bool:
    """Whether decoder layer `index` attends over a sliding window (as transformers' models pick their masks)."""
    types = getattr(config, "layer_types", None)
    if types is not None and len(types) == config.num_hidden_layers:
        return types[index] == "sliding_attention"
    return getattr(config, "sliding_window", None) is not None


class GenerationStage:
    """Blocks `first .. first + len(blocks) - 1` of an `HFCausalLM` (built, loaded and, under tensor parallelism,
    split), with the key/value cache of its decoder layers. `forward` takes the token ids (first stage) or the
    previous stage's hidden states, and returns hidden states, or the last position's logits (last stage)."""

    def __init__(self, config: Any, blocks: list[nn.Module], first: int) -> None:
        self.config, self.blocks, self.first = config, blocks, first
        self.cache: Any = None
        self.reset()

    def reset(self) -> None:
        """An empty cache, for the next batch of prompts."""
        self.cache = require_transformers().DynamicCache(config=self.config)

    @property
    def is_first(self) -> bool:
        return isinstance(self.blocks[0], Embedding)

    @property
    def is_last(self) -> bool:
        return isinstance(self.blocks[-1], Head)

    def _masks(self, hidden: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor) -> dict[bool, Any]:
        """The full and the sliding-window masks this stage's layers need, built before the cache grows."""
        masks = require_transformers().masking_utils
        layers = [block for block in self.blocks if isinstance(block, DecoderLayer)]
        built: dict[bool, Any] = {}
        for block in layers:
            sliding = _sliding(self.config, block.index)
            if sliding not in built:
                build = masks.create_sliding_window_causal_mask if sliding else masks.create_causal_mask
                built[sliding] = build(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask,
                                       cache=self.cache, position_ids=positions, layer_idx=block.index)
        return built

    @torch.no_grad()
    def forward(self, inputs: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One step: `inputs` (`[batch, new tokens]` ids, or `[batch, new tokens, hidden]`), `attention_mask`
        (`[batch, tokens so far + new]`, 0 at padding), `positions` (`[batch, new tokens]`)."""
        hidden = inputs
        masks: dict[bool, Any] | None = None
        for block in self.blocks:
            if isinstance(block, Embedding):
                hidden = self._embed(block, hidden, positions)
            elif isinstance(block, DecoderLayer):
                if masks is None:
                    masks = self._masks(hidden, attention_mask, positions)
                hidden = self._layer(block, hidden, masks[_sliding(self.config, block.index)], positions)
            else:
                hidden = block.logits(hidden[:, -1:])[:, -1]
        return hidden

    @staticmethod
    def _embed(block: Embedding, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return block.embed(ids, positions)

    def _layer(self, block: DecoderLayer, hidden: torch.Tensor, mask: Any, positions: torch.Tensor) -> torch.Tensor:
        inputs: dict[str, Any] = {"attention_mask": mask, "cache": self.cache, "use_cache": True}
        if block.position_ids:
            inputs["position_ids"] = positions
        if block.rotary is not None:
            inputs["position_embeddings"] = block.rotary_tables(hidden, positions)
        return block.layer(hidden, **inputs)

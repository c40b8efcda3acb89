"""The attention mask of packed documents (`--pack documents`): block-diagonal by document, built per micro-batch
from the per-token positions that cross the stage boundary with the hidden states."""

from __future__ import annotations

from typing import Any

import torch

from pipetrain.errors import ConfigError
from pipetrain.workloads.hf.families import causal_mask, require_transformers

__all__ = ["document_mask"]


def document_mask(family_mask: Any, config: Any, hidden: torch.Tensor, positions: torch.Tensor, index: int) -> Any:
    """The attention mask of packed documents: a token attends to the earlier tokens of its own document only (a
    document starts where the positions do not go up by one). For the causal families, transformers' own
    packed-sequence path (`create_causal_mask` with `position_ids`: `find_packed_sequence_indices`); for another
    mask (sliding windows), the family's mask of the window and-ed with the same-document blocks. On the meta
    device (shape inference) the family's mask: the documents need the positions' values, which meta has not."""
    if hidden.device.type == "meta":
        return family_mask(config, hidden, index)
    masks = require_transformers().masking_utils
    if family_mask is causal_mask:
        return masks.create_causal_mask(config=config, inputs_embeds=hidden, attention_mask=None, cache=None,
                                        position_ids=positions)
    mask = family_mask(config, hidden, index)
    documents = masks.find_packed_sequence_indices(positions)
    if documents is None:
        return mask
    same = documents[:, None, :, None] == documents[:, None, None, :]
    if mask is None:  # the family's mask is plain causal (sdpa's is_causal)
        length = hidden.shape[1]
        return same & torch.ones(length, length, dtype=torch.bool, device=hidden.device).tril()
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
        return mask & same
    if isinstance(mask, torch.Tensor):  # an additive float mask (eager attention)
        return mask.masked_fill(~same, torch.finfo(mask.dtype).min)
    raise ConfigError(f"--pack documents cannot combine the {config._attn_implementation} attention's "
                      f"{type(mask).__name__} mask with documents", hint="use attn_implementation 'sdpa' or 'eager'")

"""Per-token and per-sequence log-probabilities of the labels under a causal LM's logits.

The labels are the next tokens, aligned with the logits (pipetrain's convention: position t's logits predict
label t; `IGNORE_INDEX` marks what does not count: prompts, padding). A sequence's sum is over its own row only,
so it is exact whatever the micro-batches, replicas or schedules: a row never spans two micro-batches.
"""

from __future__ import annotations

import torch

from pipetrain.pipeline.loss import IGNORE_INDEX

__all__ = ["token_logps", "sequence_logps"]


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability of each label `[batch, seq]` (0 where ignored), the mask of labels that count
    `[batch, seq]` float), computed in float32 at least (TRL's `selective_log_softmax`: logits minus their
    log-sum-exp at the label)."""
    mask = labels != IGNORE_INDEX
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    index = labels.masked_fill(~mask, 0).unsqueeze(-1)
    picked = torch.gather(logits, -1, index).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return picked * mask, mask.to(picked.dtype)


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of each row's label log-probabilities `[batch]`, how many labels count in each row `[batch]`)."""
    logps, mask = token_logps(logits, labels)
    return logps.sum(dim=1), mask.sum(dim=1)

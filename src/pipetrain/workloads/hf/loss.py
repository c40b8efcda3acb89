"""The next-token loss of a causal LM, as transformers computes it, as a pipetrain `Loss` (sum and count)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipetrain.pipeline.loss import IGNORE_INDEX

__all__ = ["CausalLMLoss", "causal_lm_loss"]


class CausalLMLoss:
    """Next-token cross-entropy as transformers computes it (`model(input_ids, labels=labels).loss`): position t
    predicts label t+1, labels equal to `ignore_index` (padding) are skipped. As a pipetrain `Loss` (sum and
    count), the engine averages it over the non-padding tokens of the global batch, whatever the split.
    Calling it gives the mean (transformers' loss)."""

    perplexity = True
    #: position t is scored against target t + 1: context parallelism shifts the targets before cutting sequences
    shifts_targets = True

    def __init__(self, ignore_index: int = IGNORE_INDEX) -> None:
        self.ignore_index = ignore_index

    def total(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = output[:, :-1].flatten(0, 1).float()
        return F.cross_entropy(logits, target[:, 1:].flatten(), ignore_index=self.ignore_index, reduction="sum")

    def count(self, target: torch.Tensor) -> torch.Tensor:
        return (target[:, 1:] != self.ignore_index).sum()

    def correct(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor | None:
        shifted = target[:, 1:]
        return ((output[:, :-1].argmax(dim=-1) == shifted) & (shifted != self.ignore_index)).sum()

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.total(output, target) / self.count(target).clamp_min(1)


#: the loss to give the engine (`build_session(..., loss_fn=causal_lm_loss)`), with the labels as targets
causal_lm_loss = CausalLMLoss()

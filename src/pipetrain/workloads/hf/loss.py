"""The next-token loss of a causal LM, as transformers computes it, as a pipetrain `Loss` (sum and count)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from pipetrain.pipeline.loss import IGNORE_INDEX, vocab_argmax

__all__ = ["CausalLMLoss", "causal_lm_loss", "vocab_argmax"]


class CausalLMLoss:
    """Next-token cross-entropy as transformers computes it (`model(input_ids, labels=labels).loss`): position t
    predicts label t+1, labels equal to `ignore_index` (padding) are skipped. As a pipetrain `Loss` (sum and
    count), the engine averages it over the non-padding tokens of the global batch, whatever the split.
    Calling it gives the mean (transformers' loss). Logits that are a DTensor sharded on the vocabulary (the
    vocabulary-parallel head, `--loss-parallel`) give the same sum where the shards lie, under torch's
    `loss_parallel()` (the engine runs the loss and its backward inside it), and the same `correct`."""

    perplexity = True
    #: position t is scored against target t + 1: context parallelism shifts the targets before cutting sequences
    shifts_targets = True

    def __init__(self, ignore_index: int = IGNORE_INDEX) -> None:
        self.ignore_index = ignore_index

    def total(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = output[:, :-1].flatten(0, 1).float()
        total = F.cross_entropy(logits, target[:, 1:].flatten(), ignore_index=self.ignore_index, reduction="sum")
        # vocabulary-parallel: a replicated DTensor whose local value is the whole sum (backward: loss_parallel's)
        return total.to_local() if isinstance(total, DTensor) else total

    def count(self, target: torch.Tensor) -> torch.Tensor:
        return (target[:, 1:] != self.ignore_index).sum()

    def correct(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor | None:
        shifted = target[:, 1:]
        return ((vocab_argmax(output[:, :-1]) == shifted) & (shifted != self.ignore_index)).sum()

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.total(output, target) / self.count(target).clamp_min(1)


#: the loss to give the engine (`build_session(..., loss_fn=causal_lm_loss)`), with the labels as targets
causal_lm_loss = CausalLMLoss()

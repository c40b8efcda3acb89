"""A batch cut for context parallelism: each rank of a stage's context-parallel group keeps its zig-zag parts of
every sequence, the targets shifted for next-token losses before the cut, and the per-token positions added.

The engine (`PipelineEngine(sequence_split=...)`) applies it to the batch every rank is given: the inputs become
`(token ids, positions)` of this rank's tokens (the positions are the global indices, or, for packed documents, the
given per-document positions cut the same way), the targets this rank's targets. The loss then counts each token
on the one rank that holds it, and the engine sums the counts over the data- and context-parallel ranks: the loss is
the token mean over the global batch.
"""

from __future__ import annotations

from typing import Any

import torch

from pipetrain.context.layout import check_length, shift_targets, zigzag_index, zigzag_split
from pipetrain.context.ulysses import check_heads
from pipetrain.errors import ConfigError
from pipetrain.pipeline.loss import Loss, TokenCrossEntropy

__all__ = ["SequenceSplit", "check_context_model", "check_context"]


def check_context_model(model: Any, cp: int) -> None:
    """Raise unless `model` can run with its sequences cut (a `BlockModel` with `context_parallel` True: its first
    block takes `(ids, positions)`, its attention blocks `use_context`; pipetrain's Hugging Face causal LMs)."""
    if not getattr(model, "context_parallel", False):
        raise ConfigError(
            f"--cp {cp} needs a model whose attention runs over a cut sequence, and {type(model).__name__} has "
            "none (context_parallel is not True): the sequence would be cut with each part attending alone",
            hint="use --workload hf (transformers' causal LMs: ring or all-to-all attention), or --cp 1")


class SequenceSplit:
    """This rank's (`rank` of `cp`) share of each batch's sequences."""

    def __init__(self, cp: int, rank: int) -> None:
        self.cp, self.rank = cp, rank
        self._shift: int | None = None  # the ignore index of a next-token loss whose shift is done here

    def loss(self, loss: Loss) -> Loss:
        """The loss to run on this rank's parts: a next-token loss (`shifts_targets`, e.g. `CausalLMLoss`)
        becomes the plain token cross-entropy of targets shifted before the cut; a per-token loss stays; a loss
        wrapping one (`base`, rebuilt by `with_base`: `moe.router.RouterAuxLoss`) wraps its cut base."""
        if getattr(loss, "shifts_targets", False):
            self._shift = loss.ignore_index
            return TokenCrossEntropy(ignore_index=loss.ignore_index)
        if isinstance(loss, TokenCrossEntropy):
            return loss
        base = getattr(loss, "base", None)
        if base is not None and hasattr(loss, "with_base"):  # a token loss plus a term (the router's auxiliary loss)
            return loss.with_base(self.loss(base))
        raise ConfigError(f"context parallelism needs a per-token loss, got {type(loss).__name__}",
                          hint="use TokenCrossEntropy (targets [batch, seq]) or the causal LM loss, or --cp 1")

    def inputs(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """`(ids,)` or `(ids, positions)` of whole sequences -> `(ids, positions)` of this rank's tokens."""
        if len(inputs) not in (1, 2):
            raise ConfigError(f"context parallelism cuts (token ids[, positions]), got {len(inputs)} input tensors",
                              hint="give token ids [batch, seq], with packed documents their positions too")
        ids = inputs[0]
        if len(inputs) == 2:
            positions = inputs[1]
        else:
            positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        return zigzag_split(ids, self.cp, self.rank), zigzag_split(positions, self.cp, self.rank)

    def targets(self, targets: torch.Tensor) -> torch.Tensor:
        """This rank's targets (shifted first for a next-token loss)."""
        if self._shift is not None:
            targets = shift_targets(targets, self._shift)
        return zigzag_split(targets, self.cp, self.rank)

    def index(self, length: int, device: Any = None) -> torch.Tensor:
        """The global indices of this rank's tokens of a `length`-token sequence."""
        return zigzag_index(length, self.cp, self.rank, device)


def check_context(model: Any, cp: int, attention: str, seq_len: int | None, tp: int = 1, *,
                  sequence_parallel: bool = False) -> None:
    """Every check of `--cp` that can fail before ranks start: the model runs cut sequences, its heads (a tp rank's
    share) split for all-to-all attention (`attention` "ulysses"), and `seq_len` (when known) cuts into 2 * cp
    zig-zag parts, each rank's part again into tp shards under `sequence_parallel`."""
    if cp == 1:
        return
    check_context_model(model, cp)
    config = getattr(model, "config", None)
    if attention == "ulysses" and config is not None:
        heads = config.num_attention_heads
        check_heads(heads, getattr(config, "num_key_value_heads", None) or heads, cp, tp)
    if seq_len is not None:
        check_length(seq_len, cp)
        if sequence_parallel and (seq_len // cp) % tp:
            raise ConfigError(f"--sequence-parallel with --cp {cp} cuts each rank's {seq_len // cp} tokens of a "
                              f"sequence over tp={tp} ranks, which does not divide them",
                              hint=f"pass a --seq-len divisible by {2 * cp * tp}, or drop --sequence-parallel")

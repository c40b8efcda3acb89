"""What the loss keeps for its backward on the last stage (pure: plain data in and out).

A cross-entropy over the vocabulary (`F.cross_entropy` = log-softmax + NLL) keeps the log-softmax of the logits,
a logits-sized tensor per micro-batch, from the loss's forward to its backward. It is computed in fp32 (pipetrain
casts a stage's outputs to fp32; the Hugging Face loss calls `.float()`; autocast runs log-softmax in fp32) and
lives outside the stage module, so no recomputation drops it and a measured profile, which times the blocks alone,
does not see it. The planner adds it to the last stage's activations of every micro-batch in flight
(`BlockCost.loss_bytes` of the model's last block; `predict` calls `add_loss`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from pipetrain.plan.model import BlockCost
from pipetrain.plan.simulate import StageCost

__all__ = ["LOSS_ELEMENT", "log_softmax_bytes", "with_loss", "add_loss", "keeps_log_softmax"]

#: bytes per element the loss computes its log-softmax in (fp32)
LOSS_ELEMENT = 4


def log_softmax_bytes(tokens: int, vocab: int, element: int = LOSS_ELEMENT) -> float:
    """Bytes per sample a cross-entropy over `vocab` classes at each of `tokens` positions keeps for backward."""
    return float(tokens * vocab * element)


def keeps_log_softmax(loss: object) -> bool:
    """Whether `loss` is a cross-entropy over the output's last dimension (a vocabulary): the losses whose
    exp(mean) is a perplexity (`Loss.perplexity`: `TokenCrossEntropy`, the Hugging Face causal-LM loss), or one
    adding a term to such a `base` (a mixture of experts' load-balancing loss)."""
    base = getattr(loss, "base", None)
    return bool(getattr(loss, "perplexity", False)) or (base is not None and keeps_log_softmax(base))


def with_loss(blocks: Sequence[BlockCost], loss: object, output_element: int = 4) -> list[BlockCost]:
    """`blocks` (a profile's: its last block outputs the logits, `output_element` bytes each) with the last block's
    `loss_bytes` set to the log-softmax of its output when `loss` keeps one; unchanged otherwise."""
    out = list(blocks)
    if out and keeps_log_softmax(loss):
        out[-1] = replace(out[-1], loss_bytes=out[-1].output_bytes * LOSS_ELEMENT / output_element)
    return out


def add_loss(cost: StageCost, loss_bytes: float) -> StageCost:
    """The last stage's `cost` with `loss_bytes` (per micro-batch) held from each forward to its backward, whether
    the micro-batch recomputes or not (the loss runs outside the stage's checkpoint)."""
    if not loss_bytes:
        return cost
    held = cost.input_bytes if cost.held_bytes is None else cost.held_bytes
    again = cost.activation_bytes if cost.recompute_bytes is None else cost.recompute_bytes
    return replace(cost, activation_bytes=cost.activation_bytes + loss_bytes, held_bytes=held + loss_bytes,
                   recompute_bytes=again + loss_bytes)

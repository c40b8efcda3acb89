"""What the last stage holds besides its blocks' activations: the loss's saved tensors and the kept outputs (pure).

A cross-entropy over the vocabulary (`F.cross_entropy` = log-softmax + NLL) keeps the log-softmax of the logits,
a logits-sized tensor per micro-batch, from the loss's forward to its backward. It is computed in fp32 (pipetrain
casts the outputs autocast made bf16 to fp32 before the loss; the Hugging Face loss calls `.float()`) and the loss
runs after the stage's checkpointed blocks, so no recomputation drops it and a measured profile, which times the
blocks alone, does not see it. The planner adds it to the last stage's activations of every micro-batch in flight
(`BlockCost.loss_bytes` of the model's last block; `predict` calls `last_stage`).

The last stage's outputs (the logits of a language model) die with the loss's forward: pipetrain's last stage
computes its loss inside its forward (`pipetrain.pipeline.head.LossHead`), so torch's stage keeps the loss, a
scalar, for the backward, not the logits (as torchtitan, whose loss frees them once computed). Under bf16 the
logits and their fp32 cast live for a moment beside the log-softmax as the loss's forward runs (1.5 logits-sized
fp32 tensors more for `TokenCrossEntropy`), no more than the backward's temporaries below (2), which the planner
counts; no term models that moment. A caller that reads a
training step's outputs (`PipelineEngine.keep_outputs`, `plan --keep-outputs`) has each micro-batch's outputs kept to
the step's end and merged into one more copy there (`torch.cat`); the simulator then holds them from each forward to
the step's end, twice at the end (`StageCost.kept_bytes`).

The loss's backward allocates logits-sized fp32 temporaries beside the saved log-softmax, for a moment, as each of
the last stage's backwards starts (`StageCost.transient_bytes`). `F.cross_entropy` (aten's fused log-softmax and
NLL): `nll_loss_backward`'s gradient (zeros with -1 at the targets) and `_log_softmax_backward_data`'s output, both
alive with the saved log-softmax: 3 logits-sized tensors at the peak, 1 left (the logits' gradient), measured on
the CPU by `benchmarks/memory_terms.py` (a dispatch mode counting each storage while it lives: 3.000 and 1.000
logits). torch's `loss_parallel` (vocabulary-parallel logits, torch/distributed/tensor/parallel/loss.py,
`_nll_loss_and_log_softmax_backward`): `zeros_like(x)`, `exp(x)`, their sum and its product with the output's
gradient, 4 at the peak with the saved log-softmax (read from the source: DTensor's handlers run those ops below
the dispatch modes a CPU measurement can install).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from pipetrain.plan.events import StageCost
from pipetrain.plan.model import BlockCost

__all__ = ["LOSS_ELEMENT", "BACKWARD_TEMPORARIES", "VOCAB_PARALLEL_BACKWARD_TEMPORARIES", "log_softmax_bytes",
           "with_loss", "last_stage", "keeps_log_softmax"]

#: bytes per element the loss computes its log-softmax in (fp32)
LOSS_ELEMENT = 4
#: logits-sized tensors the loss's backward allocates beside the saved log-softmax (module docstring):
#: `F.cross_entropy`'s NLL gradient and log-softmax gradient
BACKWARD_TEMPORARIES = 2
#: the same under torch's `loss_parallel` (vocabulary-parallel logits): zeros_like, exp, their sum, the product
VOCAB_PARALLEL_BACKWARD_TEMPORARIES = 3


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


def last_stage(cost: StageCost, block: BlockCost, samples: int, tp: int = 1, *, keep: bool = True) -> StageCost:
    """The last stage's `cost` (its last block `block`, micro-batches of `samples`, one of `tp` ranks: a share of a
    vocabulary-parallel head's) with what it holds besides its blocks' activations: the loss's `loss_bytes` from
    each forward to its backward, whether the micro-batch recomputes or not (the loss runs outside the stage's
    checkpoint), and its backward's temporaries as each backward starts (`StageCost.transient_bytes`: torch's
    `loss_parallel` ones when the head is vocabulary-parallel over tp > 1 ranks). With `keep` (the caller reads the
    step's outputs) its outputs too, from each forward to the step's end and merged into one more copy there
    (`StageCost.kept_bytes`); without, the outputs die with the loss's forward (module docstring)."""
    split = block.tensor is not None
    share = samples / (tp if split else 1)
    loss, output = share * block.loss_bytes, share * block.output_bytes
    kept = output if keep else 0.0
    if not loss:
        return replace(cost, kept_bytes=kept)
    held = cost.input_bytes if cost.held_bytes is None else cost.held_bytes
    again = cost.activation_bytes if cost.recompute_bytes is None else cost.recompute_bytes
    temporaries = VOCAB_PARALLEL_BACKWARD_TEMPORARIES if split and tp > 1 else BACKWARD_TEMPORARIES
    return replace(cost, activation_bytes=cost.activation_bytes + loss, held_bytes=held + loss,
                   recompute_bytes=again + loss, kept_bytes=kept, transient_bytes=temporaries * loss)

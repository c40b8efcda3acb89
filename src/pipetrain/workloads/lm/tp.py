"""The tensor-parallel plan of the GPT-style decoder (`GPTModel.tp_plan`): Megatron's split of each layer.

Each decoder layer: the fused (q, k, v) projection column-parallel by heads (`FusedColwiseParallel(3)`), the
attention output projection row-parallel, the MLP's first linear column-parallel and its second row-parallel:
two all-reduces forward and two backward per layer. The embedding and the head are kept whole on every TP rank.

With `sequence_parallel` (torchtitan's way): the norms run on this rank's sequence shard (`SequenceParallel`),
the column-parallel projections all-gather the sequence and the row-parallel ones reduce-scatter it back, so
the residual stream between layers, and between pipeline stages, is the local `[batch, seq / tp, emsize]`
shard. The embedding cuts its output to the shard (`scatter_sequence`), the head gathers it back
(`gather_sequence`). The padding mask crosses whole.

With `loss_parallel` (the vocabulary-parallel head): the head's linear is column-parallel over the vocabulary
and returns a DTensor of logits sharded on the vocabulary, which the engine's cross-entropy reads under
`torch.distributed.tensor.parallel.loss_parallel()` (no rank holds the whole logits during the step).
"""

from __future__ import annotations

from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from pipetrain.parallel.tensor import TPPlan, check_divides, check_sequence
from pipetrain.compat.tensor_styles import SEQUENCE, FusedColwiseParallel, gather_sequence, scatter_sequence
from pipetrain.workloads.lm.presets import GPTConfig

__all__ = ["gpt_tp_plan", "check_divides", "check_sequence"]  # the checks live in parallel.tensor


def gpt_tp_plan(config: GPTConfig, index: int, tp: int, *, sequence_parallel: bool = False,
                loss_parallel: bool = False) -> TPPlan:
    """Block `index`'s plan: decoder layers split as above; the embedding (0) whole (cutting its output to the
    sequence shard under `sequence_parallel`); the head (last) whole, or vocabulary-parallel (`loss_parallel`)."""
    check_divides(tp, "attention heads", config.nhead, "--tp")
    check_divides(tp, "MLP hidden units", config.mlp_ratio * config.emsize, "--tp")
    check_sequence(tp, config.seq_len, sequence_parallel)
    if loss_parallel:
        check_divides(tp, "vocabulary entries", config.vocab_size, "--tp (or drop --loss-parallel)")
    if index == 0:
        return {"dropout": scatter_sequence()} if sequence_parallel else None
    if index == config.num_blocks - 1:
        head: dict[str, ParallelStyle] = {"norm": gather_sequence()} if sequence_parallel else {}
        if loss_parallel:
            head["linear"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        return head or None
    if not sequence_parallel:
        return {"qkv": FusedColwiseParallel(3), "proj": RowwiseParallel(),
                "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}
    return {"norm1": SequenceParallel(use_local_output=True),
            "qkv": FusedColwiseParallel(3, input_layouts=SEQUENCE), "proj": RowwiseParallel(output_layouts=SEQUENCE),
            "norm2": SequenceParallel(use_local_output=True),
            "mlp.0": ColwiseParallel(input_layouts=SEQUENCE), "mlp.2": RowwiseParallel(output_layouts=SEQUENCE)}

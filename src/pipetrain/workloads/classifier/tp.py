"""The tensor-parallel plan of the reference classifier (`TransformerClassifier.tp_plan`).

Each `nn.TransformerEncoderLayer`: self-attention split by heads (`HeadParallelAttention`: packed in_proj by
heads, out_proj row-parallel), `linear1` column-parallel and `linear2` row-parallel. The embedding and the
classification head are kept whole on every TP rank. With `sequence_parallel`, as in the decoder's plan
(`pipetrain.workloads.lm.tp`): norms and dropouts on the local sequence shard, the embedding's output cut to
it, the head's input gathered back.
"""

from __future__ import annotations

from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from pipetrain.errors import ConfigError
from pipetrain.parallel.tensor import TPPlan, check_divides, check_sequence
from pipetrain.compat.tensor_styles import SEQUENCE, HeadParallelAttention, gather_sequence, scatter_sequence
from pipetrain.workloads.classifier.presets import TransformerConfig

__all__ = ["classifier_tp_plan"]


def classifier_tp_plan(config: TransformerConfig, index: int, tp: int, *, sequence_parallel: bool = False,
                       loss_parallel: bool = False) -> TPPlan:
    """Block `index`'s plan: encoder layers split as above, embedding (0) and head (last) whole."""
    check_divides(tp, "attention heads", config.nhead, "--tp")
    check_divides(tp, "feed-forward units (nhid)", config.nhid, "--tp")
    check_sequence(tp, config.seq_len, sequence_parallel)
    if loss_parallel:
        raise ConfigError("--loss-parallel splits a language model's vocabulary head, but the classifier's head has "
                          f"{config.num_classes} classes", hint="drop --loss-parallel")
    if index == 0:
        return {"dropout": scatter_sequence()} if sequence_parallel else None
    if index == config.num_blocks - 1:
        return {"norm": gather_sequence()} if sequence_parallel else None
    if not sequence_parallel:
        return {"self_attn": HeadParallelAttention(), "linear1": ColwiseParallel(), "linear2": RowwiseParallel()}
    return {"norm1": SequenceParallel(use_local_output=True), "self_attn": HeadParallelAttention(sequence_parallel=True),
            "norm2": SequenceParallel(use_local_output=True),
            "linear1": ColwiseParallel(input_layouts=SEQUENCE), "linear2": RowwiseParallel(output_layouts=SEQUENCE)}

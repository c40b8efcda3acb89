"""The tensor-parallel plan of the reference classifier (`TransformerClassifier.tp_plan`).

Each `nn.TransformerEncoderLayer`: self-attention split by heads (`HeadParallelAttention`: packed in_proj by
heads, out_proj row-parallel), `linear1` column-parallel and `linear2` row-parallel. The embedding and the
classification head are kept whole on every TP rank.
"""

from __future__ import annotations

from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from pipetrain.parallel.tensor import TPPlan
from pipetrain.parallel.tensor_styles import HeadParallelAttention
from pipetrain.workloads.gpt_tp import check_divides, refuse_sequence_parallel
from pipetrain.workloads.presets import TransformerConfig

__all__ = ["classifier_tp_plan"]


def classifier_tp_plan(config: TransformerConfig, index: int, tp: int, *, sequence_parallel: bool = False) -> TPPlan:
    """Block `index`'s plan: encoder layers split as above, embedding (0) and head (last) whole."""
    check_divides(tp, "attention heads", config.nhead, "--tp")
    check_divides(tp, "feed-forward units (nhid)", config.nhid, "--tp")
    refuse_sequence_parallel("classifier", sequence_parallel)
    if index in (0, config.num_blocks - 1):
        return None
    return {"self_attn": HeadParallelAttention(), "linear1": ColwiseParallel(), "linear2": RowwiseParallel()}

"""The tensor-parallel plans of the Hugging Face causal LM blocks (`HFCausalLM.tp_plan`): Megatron's split.

Each decoder layer is split by its family's plan (`Family.layer_tp_plan`: Llama's in `families/llama.py`, GPT-2's
in `families/gpt2.py`, Phi-3's in `families/phi3.py`, a q/k norm's over the heads added by the description), which
also refuses a tp that does not divide the heads (GQA: the key/value heads too) or the MLP. The embedding, the
norms and the head are kept whole on every TP rank, unless `loss_parallel` (`--loss-parallel`, torchtitan's
vocabulary-parallel head and embedding): then the head's `lm_head` is column-parallel over the vocabulary and
returns its logits as a DTensor sharded on the vocabulary (the engine's loss runs under torch's `loss_parallel()`,
`CausalLMLoss` reads the shards), and the token embedding is row-parallel over the vocabulary (each rank looks up
its rows, one all-reduce makes the hidden states whole). Both matrices are then split on the vocabulary alike
(rows of `[vocab, hidden]`), so a tied embedding and head (`tied_parameters`) stay one tensor shard by shard.

Under `sequence_parallel` (families with a `sequence_tp_plan`: Llama and the families described as Llama), the
residual stream between layers, and between pipeline stages, is this rank's `[batch, seq / tp, hidden]` shard:
the embedding cuts its output to the shard (`scatter_sequence` on its dropout), each layer runs its norms on the
shard (`families/llama.py`), the head gathers the sequence back before its norm (`gather_sequence`). Packed
documents (their positions cross stages beside the hidden states) are refused with it.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from pipetrain.compat.tensor_styles import Conv1DParallel, LocalSplitSize, gather_sequence, scatter_sequence
from pipetrain.errors import ConfigError
from pipetrain.parallel.tensor import TPPlan, check_divides, check_sequence
from pipetrain.workloads.hf.families import FAMILIES, Family, gpt2_tp_plan, llama_tp_plan

__all__ = ["hf_tp_plan", "vocab_parallel_plan", "llama_tp_plan", "gpt2_tp_plan", "Conv1DParallel", "LocalSplitSize"]


def hf_tp_plan(config: Any, family: Family | str, index: int, num_blocks: int, tp: int, *,
               sequence_parallel: bool = False, loss_parallel: bool = False, seq_len: int | None = None,
               documents: bool = False) -> TPPlan:
    """Block `index`'s plan: decoder layers split by the family's plan; the embedding (0) and the head (last) whole,
    or split over the vocabulary under `loss_parallel` (`vocab_parallel_plan`); under `sequence_parallel` the
    embedding scatters the sequence and the head gathers it (`seq_len`: the length tp must divide)."""
    family = FAMILIES[family] if isinstance(family, str) else family
    if family.tp_plan is None:
        raise ConfigError(f"the Hugging Face {family.name} model has no tensor-parallel plan, so --tp {tp} cannot "
                          "split it", hint="run it with --tp 1")
    plan = family.layer_tp_plan(config, tp, sequence_parallel=sequence_parallel)
    if sequence_parallel and documents:
        raise ConfigError("--sequence-parallel with packed documents (--pack documents): their positions cross the "
                          "stages beside the hidden states, which this version does not cut",
                          hint="drop --sequence-parallel, or pack windows")
    if sequence_parallel and seq_len is not None:
        check_sequence(tp, seq_len, sequence_parallel)
    if index not in (0, num_blocks - 1):
        return plan
    ends = vocab_parallel_plan(config, family, index == 0, tp) if loss_parallel else {}
    if sequence_parallel:  # the embedding's last submodule cuts the sequence, the head's first gathers it
        ends = {**ends, **({"drop": scatter_sequence()} if index == 0 else {"norm": gather_sequence()})}
    return ends or None


def vocab_parallel_plan(config: Any, family: Family, embedding: bool, tp: int) -> dict:
    """The vocabulary-parallel plan of the embedding block (`embedding`) or of the head block: the token embedding
    row-parallel (its input ids whole, its hidden states made whole), the head's projection column-parallel with
    its logits left sharded on the vocabulary (a DTensor, read by the loss under `loss_parallel()`)."""
    check_divides(tp, "vocabulary entries", config.vocab_size, "--tp (or drop --loss-parallel)")
    if embedding:
        return {family.embed.rpartition(".")[2]: RowwiseParallel(input_layouts=Replicate())}
    return {"lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}

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
No sequence parallelism yet.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from pipetrain.compat.tensor_styles import Conv1DParallel, LocalSplitSize
from pipetrain.errors import ConfigError
from pipetrain.parallel.tensor import TPPlan, check_divides
from pipetrain.workloads.hf.families import FAMILIES, Family, gpt2_tp_plan, llama_tp_plan

__all__ = ["hf_tp_plan", "vocab_parallel_plan", "llama_tp_plan", "gpt2_tp_plan", "Conv1DParallel", "LocalSplitSize"]


def hf_tp_plan(config: Any, family: Family | str, index: int, num_blocks: int, tp: int, *,
               sequence_parallel: bool = False, loss_parallel: bool = False) -> TPPlan:
    """Block `index`'s plan: decoder layers split by the family's plan; the embedding (0) and the head (last) whole,
    or split over the vocabulary under `loss_parallel` (`vocab_parallel_plan`)."""
    family = FAMILIES[family] if isinstance(family, str) else family
    if family.tp_plan is None:
        raise ConfigError(f"the Hugging Face {family.name} model has no tensor-parallel plan, so --tp {tp} cannot "
                          "split it", hint="run it with --tp 1")
    plan = family.layer_tp_plan(config, tp)
    if sequence_parallel:
        raise ConfigError(f"--sequence-parallel is not available for the Hugging Face {family.name} model's TP plan "
                          "in this version (its norms and head stay whole)",
                          hint="drop --sequence-parallel (tensor parallelism without it is exact)")
    if index in (0, num_blocks - 1):
        return vocab_parallel_plan(config, family, index == 0, tp) if loss_parallel else None
    return plan


def vocab_parallel_plan(config: Any, family: Family, embedding: bool, tp: int) -> TPPlan:
    """The vocabulary-parallel plan of the embedding block (`embedding`) or of the head block: the token embedding
    row-parallel (its input ids whole, its hidden states made whole), the head's projection column-parallel with
    its logits left sharded on the vocabulary (a DTensor, read by the loss under `loss_parallel()`)."""
    check_divides(tp, "vocabulary entries", config.vocab_size, "--tp (or drop --loss-parallel)")
    if embedding:
        return {family.embed.rpartition(".")[2]: RowwiseParallel(input_layouts=Replicate())}
    return {"lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}

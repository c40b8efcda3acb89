"""The tensor-parallel plans of the Hugging Face causal LM blocks (`HFCausalLM.tp_plan`): Megatron's split.

Each decoder layer is split by its family's plan (`Family.layer_tp_plan`: Llama's in `families/llama.py`, GPT-2's
in `families/gpt2.py`, Phi-3's in `families/phi3.py`, a q/k norm's over the heads added by the description), which
also refuses a tp that does not divide the heads (GQA: the key/value heads too) or the
MLP; the embedding, the norms and the head are kept whole on every TP rank (no vocabulary-parallel head, no
sequence parallelism).
"""

from __future__ import annotations

from typing import Any

from pipetrain.compat.tensor_styles import Conv1DParallel, LocalSplitSize
from pipetrain.errors import ConfigError
from pipetrain.parallel.tensor import TPPlan
from pipetrain.workloads.hf.families import FAMILIES, Family, gpt2_tp_plan, llama_tp_plan

__all__ = ["hf_tp_plan", "llama_tp_plan", "gpt2_tp_plan", "Conv1DParallel", "LocalSplitSize"]


def hf_tp_plan(config: Any, family: Family | str, index: int, num_blocks: int, tp: int, *,
               sequence_parallel: bool = False) -> TPPlan:
    """Block `index`'s plan: decoder layers split by the family's plan, embedding (0) and head (last) whole."""
    family = FAMILIES[family] if isinstance(family, str) else family
    if family.tp_plan is None:
        raise ConfigError(f"the Hugging Face {family.name} model has no tensor-parallel plan, so --tp {tp} cannot "
                          "split it", hint="run it with --tp 1")
    plan = family.layer_tp_plan(config, tp)
    if sequence_parallel:
        raise ConfigError(f"--sequence-parallel is not available for the Hugging Face {family.name} model's TP plan "
                          "in this version (its norms and head stay whole)",
                          hint="drop --sequence-parallel (tensor parallelism without it is exact)")
    return None if index in (0, num_blocks - 1) else plan

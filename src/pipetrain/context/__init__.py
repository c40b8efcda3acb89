"""Context parallelism: each sequence cut over the ranks of a stage, attention over the whole of it by a ring of
key/value blocks or by all-to-all, registered as a transformers attention function."""

from pipetrain.context.attention import ATTENTION_NAME, CP_ATTENTIONS, ContextMask, ContextParallel, context_attention
from pipetrain.context.layout import check_length, shift_targets, zigzag_index, zigzag_split
from pipetrain.context.split import SequenceSplit, check_context, check_context_model

__all__ = ["ATTENTION_NAME", "CP_ATTENTIONS", "ContextMask", "ContextParallel", "context_attention", "SequenceSplit", "check_context", "check_context_model",
           "check_length", "shift_targets", "zigzag_index", "zigzag_split"]

"""Frozen, keyword-only configuration dataclasses, one per component, validated on construction: the accepted
words (`choices`), one pipeline (`pipeline`), the device mesh around it (`parallel`)."""

from __future__ import annotations

from pipetrain.config.choices import (CHECKPOINT_POLICIES, CP_ATTENTIONS, DP_MODES, FSDP_RESHARD, PARTITION_METHODS,
                                      RECOMPUTE_UNITS, SCHEDULES, SELECTIVE_MATMULS, SHARDED_DP_MODES,
                                      SPLIT_BACKWARD_SCHEDULES, V_SCHEDULES, schedule_is_multi_stage)
from pipetrain.config.parallel import ParallelConfig
from pipetrain.config.pipeline import PipelineConfig

__all__ = [
    "SCHEDULES",
    "CHECKPOINT_POLICIES",
    "DP_MODES",
    "PARTITION_METHODS",
    "PipelineConfig",
    "ParallelConfig",
    "schedule_is_multi_stage",
    "V_SCHEDULES",
    "SPLIT_BACKWARD_SCHEDULES",
    "CP_ATTENTIONS",
    "RECOMPUTE_UNITS",
    "SELECTIVE_MATMULS",
    "FSDP_RESHARD",
    "SHARDED_DP_MODES",
]

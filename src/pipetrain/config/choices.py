"""The words and numbers a configuration accepts: schedules, recomputation policies, data-parallel modes,
attention kinds; and the two checks every configuration class uses."""

from __future__ import annotations

from pipetrain.errors import ConfigError

__all__ = ["SCHEDULES", "V_SCHEDULES", "SPLIT_BACKWARD_SCHEDULES", "CHECKPOINT_POLICIES", "CP_ATTENTIONS", "DP_MODES",
           "SHARDED_DP_MODES", "RECOMPUTE_UNITS", "SELECTIVE_MATMULS", "FSDP_RESHARD", "PARTITION_METHODS",
           "schedule_is_multi_stage", "PRECISION_NAMES", "check_precision"]

#: Schedule name -> number of stages each pipeline rank holds by default.
SCHEDULES: dict[str, int] = {
    "gpipe": 1,
    "1f1b": 1,
    "interleaved-1f1b": 2,
    "zero-bubble": 2,
    "zbv": 2,
    "dualpipev": 2,
}
#: The V-shaped schedules: pipeline rank r of p holds stages r and 2p - 1 - r (the others: r, r + p, ...).
V_SCHEDULES = ("zbv", "dualpipev")
#: The schedules that split a backward into its input and weight parts (and DDP cannot run: see ParallelConfig).
SPLIT_BACKWARD_SCHEDULES = ("zero-bubble", "zbv", "dualpipev")
CHECKPOINT_POLICIES = ("never", "except_last", "always")
#: `--cp-attention`: how attention sees a sequence cut over the context-parallel ranks (pipetrain.context)
CP_ATTENTIONS = ("ring", "ulysses")
DP_MODES = ("ddp", "fsdp", "hsdp")
#: the data-parallel modes that shard parameters with FSDP2 (hsdp: replicated across groups, sharded within)
SHARDED_DP_MODES = ("fsdp", "hsdp")
#: what one recomputation checkpoints: the whole stage, each block (`layer`), or each block's cheap ops only
RECOMPUTE_UNITS = ("stage", "layer", "selective")
#: `--selective-matmuls`: which matrix products a selectively recomputed block keeps: all, or every other one
#: (the 1st, 3rd, ... of each block's forward: torchtitan's op-level policy)
SELECTIVE_MATMULS = ("all", "alternate")
#: `--fsdp-reshard` words (an integer N >= 2 is also accepted: reshard to groups of N ranks after forward)
FSDP_RESHARD = ("never", "always", "auto")
PARTITION_METHODS = ("parameters", "uniform", "time", "memory", "priced")
#: `--precision` (each one's dtype: `pipetrain.pipeline.precision.PRECISIONS`)
PRECISION_NAMES = ("fp32", "fp32-strict", "bf16")
#: precisions pipetrain does not run, and why
_UNSUPPORTED_PRECISIONS = {
    "fp16": "fp16 needs loss scaling coordinated across stages, which pipetrain does not implement; "
    "use bf16 (same speed on recent GPUs, no loss scaling needed)",
}


def schedule_is_multi_stage(schedule: str) -> bool:
    """True for the schedules that put several (virtual) stages on each rank."""
    return SCHEDULES[schedule] > 1


def _choice(name: str, value: str, allowed: tuple[str, ...] | dict[str, int]) -> None:
    if value not in allowed:
        raise ConfigError(
            f"unknown {name} {value!r}", hint=f"choose one of: {', '.join(allowed)}"
        )


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}", hint=f"pass {name} >= 1")


def check_precision(precision: str) -> str:
    """Return `precision` if pipetrain supports it, else raise one ConfigError naming the supported values."""
    if precision in PRECISION_NAMES:
        return precision
    why = _UNSUPPORTED_PRECISIONS.get(precision, "")
    raise ConfigError(
        f"precision {precision!r} is not supported" + (f": {why}" if why else ""),
        hint=f"pass --precision {', '.join(PRECISION_NAMES[:-1])} or {PRECISION_NAMES[-1]} (default fp32)",
    )

"""Per-block costs of a `BlockModel`, and the balance a `PipelineConfig` asks for."""

from __future__ import annotations

from dataclasses import replace

import torch

from pipetrain.blocks import BlockModel
from pipetrain.config import PipelineConfig
from pipetrain.errors import ConfigError
from pipetrain.partition.measure import model_fingerprint, profile_model
from pipetrain.partition.profile import ModelProfile
from pipetrain.partition.solver import solve_balance, uniform_balance
from pipetrain.partition.stagecost import COST_METHODS, BalanceChoice, balance_by_cost, check_mem_cap

__all__ = ["parameter_costs", "resolve_balance", "cost_balance"]

#: Timed runs per block when a run profiles its model at start (no --profile given).
START_REPEATS = 5


def parameter_costs(model: BlockModel) -> list[int]:
    """The number of parameters of each block, in order.

    Each block is built under `torch.device("meta")`, so parameters get shapes but no storage; a block
    whose `build_block` copies existing tensors (e.g. `ModuleListModel`) may still use memory for the copy.
    Parameters shared inside one block are counted once.
    """
    costs = []
    for index in range(model.num_blocks):
        with torch.device("meta"):
            block = model.build_block(index)
        costs.append(sum(param.numel() for param in block.parameters()))
        del block
    return costs


def resolve_balance(model: BlockModel, pipeline_config: PipelineConfig) -> list[int]:
    """The block count of each of the `pipeline_config.num_stages` stages.

    The explicit `balance` when given; otherwise `uniform` counts, or (`parameters`) the split that
    minimises the largest per-stage parameter count (see `solve_balance` for the tie rules).
    """
    num_blocks = model.num_blocks
    pipeline_config.check_blocks(num_blocks)
    if pipeline_config.balance is not None:
        return list(pipeline_config.balance)
    if pipeline_config.partition in (*COST_METHODS, "priced"):
        raise ConfigError(
            f"partition {pipeline_config.partition!r} needs the blocks' measured costs (priced: the folder's)",
            hint="pass balance= from pipetrain.partition.cost_balance(...), or use the CLI's --partition",
        )
    if pipeline_config.partition == "uniform":
        return uniform_balance(num_blocks, pipeline_config.num_stages)
    return solve_balance(parameter_costs(model), pipeline_config.num_stages)


def cost_balance(
    model: BlockModel,
    pipeline_config: PipelineConfig,
    *,
    micro_batch_size: int,
    profile: ModelProfile | None = None,
    mem_cap_mb: float | None = None,
    device: torch.device | str = "cpu",
    profile_source: str = "the profile",
) -> tuple[PipelineConfig, BalanceChoice]:
    """`pipeline_config` with the balance its cost method (`time` or `memory`) chooses, and that choice.

    Costs come from `profile` (checked to be of this model and micro-batch size), else they are measured
    now on `device` (a few repeats). Every rank must use the same costs: measure once and share them.
    """
    method = pipeline_config.partition
    check_mem_cap(method, mem_cap_mb)
    pipeline_config.check_blocks(model.num_blocks)
    if profile is None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as each training rank runs
        try:
            profile = profile_model(model, micro_batch_size, device=device, repeats=START_REPEATS)
        finally:
            torch.set_num_threads(threads)
    else:
        profile.check_matches(fingerprint=model_fingerprint(model), micro_batch_size=micro_batch_size,
                              source=profile_source)
    choice = balance_by_cost(profile, method=method, stages=pipeline_config.num_stages,
                             schedule=pipeline_config.schedule, chunks=pipeline_config.n_microbatches,
                             mem_cap_mb=mem_cap_mb)
    return replace(pipeline_config, balance=choice.balance), choice

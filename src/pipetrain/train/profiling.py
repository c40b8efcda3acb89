"""Profiles measured for the planner (`pipetrain profile`, `--layout auto`): `partition.measure`'s per-block costs,
with what each block keeps under selective recomputation (`BlockProfile.selective_bytes`) measured through the
pipeline's own wrapper, so that the planner prices `--checkpoint selective` from the profile as it runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from pipetrain.blocks import BlockModel
from pipetrain.partition.measure import profile_model_sizes
from pipetrain.partition.profile import ModelProfile
from pipetrain.pipeline.recompute import RecomputeWrapper

__all__ = ["measure_profile", "selective_form"]


def selective_form(block: nn.Module) -> nn.Module:
    """`block` as `--checkpoint selective` runs it: a stage of one block under `RecomputeWrapper`, unit
    "selective" (torch's selective checkpoint, `SAVED_OPS` kept)."""
    return RecomputeWrapper(nn.Sequential(block), "always", unit="selective")


def measure_profile(model: BlockModel, sizes: Sequence[int], **options: Any) -> ModelProfile:
    """`profile_model_sizes(model, sizes, **options)` with each block's selective bytes measured."""
    return profile_model_sizes(model, sizes, selective=selective_form, **options)

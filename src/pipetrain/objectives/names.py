"""The loss names `--dpo-loss` and `--grpo-loss` accept, without torch: the command line refuses a bad one before
its heavy imports."""

from __future__ import annotations

__all__ = ["DPO_LOSSES", "GRPO_LOSSES"]

#: the loss types pipetrain trains (`--dpo-loss`)
DPO_LOSSES = ("sigmoid", "robust", "ipo", "simpo")
#: the loss types pipetrain trains (`--grpo-loss`)
GRPO_LOSSES = ("dapo", "grpo")

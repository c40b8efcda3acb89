"""What a step optimises beyond next-token loss, equal to TRL's definitions: preference pairs (DPO and its relatives,
`--objective dpo`) and GRPO (`--objective grpo`). `dpo_loss`, `grpo_loss`: the losses; `pairs`: TRL's preference
rows as token pairs; `prompt_rows`: GRPO's prompts; `reference`: the reference log-probabilities through the pipeline;
`preference`, `rollout`: the workloads the trainer runs (GRPO's rollouts through the engine's own stages); `rewards`:
the user's reward functions. See docs/alignment.md."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipetrain.lazy import lazy_exports

#: public name -> the module that defines it (loaded on first use: the loss names need no torch)
_EXPORTS = {
    **dict.fromkeys(("DPO_LOSSES", "GRPO_LOSSES"), "pipetrain.objectives.names"),
    **dict.fromkeys(("DPOSettings", "PreferenceLoss", "pair_terms"), "pipetrain.objectives.dpo_loss"),
    **dict.fromkeys(("PreferencePairs", "read_pairs"), "pipetrain.objectives.pairs"),
    **dict.fromkeys(("GRPOLossSettings", "SurrogateLoss"), "pipetrain.objectives.grpo_loss"),
    "PreferenceWorkload": "pipetrain.objectives.preference",
    "GRPOSettings": "pipetrain.objectives.prompt_rows",
    "GRPOWorkload": "pipetrain.objectives.rollout",
}

__all__ = ["DPO_LOSSES", "DPOSettings", "PreferenceLoss", "pair_terms", "PreferencePairs", "read_pairs",
           "PreferenceWorkload", "GRPO_LOSSES", "GRPOLossSettings", "SurrogateLoss", "GRPOSettings", "GRPOWorkload"]

if TYPE_CHECKING:
    from pipetrain.objectives.names import DPO_LOSSES, GRPO_LOSSES
    from pipetrain.objectives.dpo_loss import DPOSettings, PreferenceLoss, pair_terms
    from pipetrain.objectives.pairs import PreferencePairs, read_pairs
    from pipetrain.objectives.grpo_loss import GRPOLossSettings, SurrogateLoss
    from pipetrain.objectives.preference import PreferenceWorkload
    from pipetrain.objectives.prompt_rows import GRPOSettings
    from pipetrain.objectives.rollout import GRPOWorkload

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

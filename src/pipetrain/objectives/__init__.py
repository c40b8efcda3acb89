"""What a step optimises beyond next-token loss: preference pairs (DPO and its relatives, `--objective dpo`),
equal to TRL's definitions. `dpo_loss`: the losses (pure); `pairs`: TRL's preference rows as token pairs;
`reference`: the reference log-probabilities through the pipeline; `preference`: the workload the trainer runs.
See docs/alignment.md."""

from __future__ import annotations

from pipetrain.objectives.dpo_loss import DPO_LOSSES, DPOSettings, PreferenceLoss, pair_terms
from pipetrain.objectives.pairs import PreferencePairs, read_pairs
from pipetrain.objectives.preference import PreferenceWorkload

__all__ = ["DPO_LOSSES", "DPOSettings", "PreferenceLoss", "pair_terms", "PreferencePairs", "read_pairs",
           "PreferenceWorkload"]

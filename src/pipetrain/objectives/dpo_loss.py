"""The DPO family of preference losses, as TRL 1.13 defines them, and the pipetrain `Loss` that trains them.

A batch holds pairs: row `2i` is pair i's chosen answer, row `2i + 1` its rejected one (both behind the same
prompt), so a pair never spans two micro-batches. The targets are the labels (answer tokens only) followed by one
float64 column, the row's reference log-probability (`columns.with_columns`). Losses per pair, from the
summed answer log-probabilities `c`, `r` (policy) and `c0`, `r0` (reference), `delta = (c - c0) - (r - r0)`:

- `sigmoid` (TRL `DPOTrainer`, `loss_type="sigmoid"`): `-logsigmoid(beta * delta)`;
- `robust` (TRL `DPOTrainer`, `"robust"`, with `label_smoothing` eps < 0.5):
  `(-(1 - eps) logsigmoid(beta delta) + eps logsigmoid(-beta delta)) / (1 - 2 eps)`;
- `ipo` (TRL `DPOTrainer`, `"ipo"`): each log-ratio divided by its answer's token count, then
  `(delta_avg - 1 / (2 beta))^2`;
- `simpo` (TRL `CPOTrainer`, `loss_type="simpo"`, `cpo_alpha=0`; reference-free): the answers' mean log-probs
  `c_avg`, `r_avg`, `x = c_avg - r_avg - gamma / beta`, `-(1 - eps) logsigmoid(beta x) - eps logsigmoid(-beta x)`.

Rewards as TRL logs them: `beta * (c - c0)` and `beta * (r - r0)` (SimPO: `beta * c_avg`, `beta * r_avg`); the
accuracy is the share of pairs whose chosen reward is above the rejected one (`rewards/accuracies`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipetrain.errors import ConfigError
from pipetrain.objectives.columns import split_columns
from pipetrain.objectives.logps import sequence_logps
from pipetrain.objectives.names import DPO_LOSSES

__all__ = ["DPO_LOSSES", "DPOSettings", "PairTerms", "pair_terms", "PreferenceLoss", "REWARD_METRICS"]

#: the metrics of a preference step, named as TRL logs them
REWARD_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                  "logps/rejected")


@dataclass(frozen=True, kw_only=True)
class DPOSettings:
    """`loss` one of `DPO_LOSSES`, `beta` (IPO's tau), `label_smoothing` (robust and simpo), `simpo_gamma`."""

    loss: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5

    def __post_init__(self) -> None:
        if self.loss not in DPO_LOSSES:
            raise ConfigError(f"--dpo-loss {self.loss!r} is not a preference loss pipetrain trains",
                              hint=f"choose one of: {', '.join(DPO_LOSSES)}")
        if not self.beta > 0:
            raise ConfigError(f"--dpo-beta {self.beta} must be positive", hint="pass --dpo-beta 0.1, for example")
        if self.label_smoothing and self.loss in ("sigmoid", "ipo"):
            raise ConfigError(f"--label-smoothing {self.label_smoothing} does not apply to --dpo-loss {self.loss} "
                              "(TRL's DPOTrainer ignores it there)",
                              hint="pass --dpo-loss robust (Robust DPO, which reads it) or --dpo-loss simpo, or drop "
                                   "--label-smoothing")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"--label-smoothing {self.label_smoothing} is outside [0, 0.5)",
                              hint="pass a flip probability such as 0.1")

    @property
    def reference_free(self) -> bool:
        """Whether the loss needs no reference log-probabilities (SimPO)."""
        return self.loss == "simpo"


@dataclass(frozen=True)
class PairTerms:
    """Per pair: the loss, the chosen and rejected rewards, the chosen and rejected answers' log-probabilities."""

    loss: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor


def pair_terms(settings: DPOSettings, logps: torch.Tensor, counts: torch.Tensor,
               reference: torch.Tensor) -> PairTerms:
    """The loss terms of pairs from per-row answer log-prob sums `logps`, answer token `counts` and reference
    sums `reference` (rows interleaved chosen, rejected; `reference` unused by SimPO)."""
    beta, eps = settings.beta, settings.label_smoothing
    c, r = logps[0::2], logps[1::2]
    nc, nr = counts[0::2].clamp(min=1.0), counts[1::2].clamp(min=1.0)
    if settings.loss == "simpo":
        c_avg, r_avg = c / nc, r / nr
        x = c_avg - r_avg - settings.simpo_gamma / beta
        loss = -F.logsigmoid(beta * x) * (1 - eps) - F.logsigmoid(-beta * x) * eps
        return PairTerms(loss, beta * c_avg.detach(), beta * r_avg.detach(), c.detach(), r.detach())
    chosen_ratio, rejected_ratio = c - reference[0::2], r - reference[1::2]
    delta = chosen_ratio - rejected_ratio
    if settings.loss == "sigmoid":
        loss = -F.logsigmoid(beta * delta)
    elif settings.loss == "robust":
        loss = (-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
    else:  # ipo: log-ratios per answer token
        loss = (chosen_ratio / nc - rejected_ratio / nr - 1 / (2 * beta)) ** 2
    return PairTerms(loss, beta * chosen_ratio.detach(), beta * rejected_ratio.detach(), c.detach(), r.detach())


class PreferenceLoss:
    """A pipetrain `Loss` over pairs: `total` sums the pair losses of a (micro-)batch, `count` counts its pairs,
    `correct` its pairs ranked right; `extras` sums the reward figures (`REWARD_METRICS`) for the step's metrics.
    Targets: labels and one reference column (`columns.with_columns`), rows interleaved chosen, rejected."""

    perplexity = False
    per_token = False  # it counts pairs (the step line shows samples/s)
    extra_names = REWARD_METRICS

    def __init__(self, settings: DPOSettings) -> None:
        self.settings = settings

    def terms(self, output: torch.Tensor, target: torch.Tensor) -> PairTerms:
        if target.shape[0] % 2:
            raise ConfigError(f"a micro-batch of {target.shape[0]} rows splits a preference pair",
                              hint="make the pairs per replica a multiple of --chunks")
        labels, reference = split_columns(target, 1)
        logps, counts = sequence_logps(output, labels)
        return pair_terms(self.settings, logps, counts, reference[:, 0].to(logps.dtype))

    def total(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.terms(output, target).loss.sum()

    def count(self, target: torch.Tensor) -> int:
        return target.shape[0] // 2

    def correct(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        terms = self.terms(output, target)
        return (terms.chosen_rewards > terms.rejected_rewards).sum()

    def extras(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        """Sums over the pairs of the batch, which the engine divides by the global count (means over pairs)."""
        t = self.terms(output, target)
        return {"rewards/chosen": t.chosen_rewards.sum(), "rewards/rejected": t.rejected_rewards.sum(),
                "rewards/margins": (t.chosen_rewards - t.rejected_rewards).sum(),
                "rewards/accuracies": (t.chosen_rewards > t.rejected_rewards).sum(),
                "logps/chosen": t.chosen_logps.sum(), "logps/rejected": t.rejected_logps.sum()}

"""GRPO's clipped surrogate, as TRL 1.13's `GRPOTrainer` computes it, and the pipetrain `Loss` that trains it.

Each row is a prompt and one of its completions; the targets are the labels (completion tokens only) followed by
float64 columns (`columns.with_columns`): the old policy's per-token log-probs (NaN: the current ones, detached,
as TRL uses when one optimisation iteration follows each generation), the reference's per-token log-probs (with a
KL term) and the row's advantage. Per completion token, with `ratio = exp(logp - old)` and advantage `A`:
`-min(ratio A, clamp(ratio, 1 - eps_low, 1 + eps_high) A)`, plus `kl_beta ratio (exp(ref - logp) - (ref - logp) - 1)`
(the KL estimate times the ratio: TRL's `use_bias_correction_kl`, its default).
`loss_type` `grpo` averages over each completion's tokens, then over completions (`count`: completions); `dapo`
(TRL's default) averages over the completion tokens of the whole batch (`count`: tokens). `extras`: the KL and the
share of tokens clipped (TRL's `kl`, `clip_ratio/region_mean`), weighted as the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipetrain.errors import ConfigError
from pipetrain.objectives.columns import split_columns
from pipetrain.objectives.logps import token_logps
from pipetrain.objectives.names import GRPO_LOSSES
from pipetrain.pipeline.loss import IGNORE_INDEX

__all__ = ["GRPO_LOSSES", "GRPOLossSettings", "surrogate", "SurrogateLoss", "grpo_columns"]


@dataclass(frozen=True, kw_only=True)
class GRPOLossSettings:
    """`loss` one of `GRPO_LOSSES`, the clip range `epsilon` (`epsilon_high`: its upper side, default the same),
    the KL coefficient `kl_beta` (0: no reference) and the sampling `temperature`."""

    loss: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    kl_beta: float = 0.0
    #: the sampling temperature: the log-probs are those of the logits divided by it, as TRL computes them
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.loss not in GRPO_LOSSES:
            raise ConfigError(f"--grpo-loss {self.loss!r} is not a GRPO loss pipetrain trains",
                              hint=f"choose one of: {', '.join(GRPO_LOSSES)}")
        if not self.epsilon > 0 or (self.epsilon_high is not None and not self.epsilon_high > 0):
            raise ConfigError(f"--epsilon {self.epsilon} must be positive", hint="pass 0.2, for example")
        if not self.temperature > 0:
            raise ConfigError(f"--temperature {self.temperature} must be positive for GRPO's sampling",
                              hint="pass 1.0 (TRL's default) or another positive value")
        if self.kl_beta < 0:
            raise ConfigError(f"--kl-beta {self.kl_beta} is negative", hint="pass 0 (no KL) or a positive value")


def grpo_columns(seq: int) -> int:
    """How many float columns a row's targets carry for `seq` labels: old and reference log-probs, advantage."""
    return 2 * seq + 1


def surrogate(settings: GRPOLossSettings, logps: torch.Tensor, mask: torch.Tensor, old: torch.Tensor,
              reference: torch.Tensor, advantages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-token loss, per-token KL, per-token clipped flag) `[batch, seq]`, zero outside `mask`."""
    old = torch.where(torch.isnan(old), logps.detach(), old.to(logps.dtype))
    ratio = torch.exp(logps - old)
    high = settings.epsilon if settings.epsilon_high is None else settings.epsilon_high
    clipped_ratio = torch.clamp(ratio, 1 - settings.epsilon, 1 + high)
    a = advantages.to(logps.dtype)[:, None]
    loss = -torch.min(ratio * a, clipped_ratio * a)
    kl = torch.zeros_like(loss)
    if settings.kl_beta:
        reference = torch.where(mask.bool(), reference.to(logps.dtype), logps.detach())  # no NaN in any gradient
        delta = reference - logps
        kl = (torch.exp(delta) - delta - 1) * ratio  # TRL's use_bias_correction_kl (its default): times the ratio
        loss = loss + settings.kl_beta * kl
    clipped = ((ratio < 1 - settings.epsilon) & (a < 0)) | ((ratio > 1 + high) & (a > 0))
    keep = mask.bool()  # (a column is NaN where no label counts: `where`, not a product, drops it)
    return (torch.where(keep, loss, 0.0), torch.where(keep, kl, 0.0),
            torch.where(keep, clipped.to(loss.dtype), 0.0))


class SurrogateLoss:
    """A pipetrain `Loss` of GRPO's clipped surrogate (see the module docstring): `dapo` counts completion tokens,
    `grpo` completions."""

    perplexity = False
    extra_names = ("kl", "clip_ratio/region_mean")

    def __init__(self, settings: GRPOLossSettings) -> None:
        self.settings = settings
        self.per_token = settings.loss == "dapo"

    def _terms(self, output: torch.Tensor, target: torch.Tensor):
        seq = (target.shape[1] - 1) // 3
        labels, columns = split_columns(target, grpo_columns(seq))
        logps, mask = token_logps(output / self.settings.temperature if self.settings.temperature != 1 else output,
                                  labels)
        loss, kl, clipped = surrogate(self.settings, logps, mask, columns[:, :seq], columns[:, seq:2 * seq],
                                      columns[:, -1])
        if self.per_token:
            return loss.sum(), kl.sum(), clipped.sum()
        tokens = mask.sum(dim=1).clamp(min=1.0)
        return (loss.sum(1) / tokens).sum(), (kl.sum(1) / tokens).sum(), (clipped.sum(1) / tokens).sum()

    def total(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self._terms(output, target)[0]

    def count(self, target: torch.Tensor) -> torch.Tensor | int:
        seq = (target.shape[1] - 1) // 3
        labels = target[:, :seq]
        return (labels != IGNORE_INDEX).sum() if self.per_token else labels.shape[0]

    def correct(self, output: torch.Tensor, target: torch.Tensor) -> None:
        return None

    def extras(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        _, kl, clipped = self._terms(output.detach(), target)
        return {"kl": kl, "clip_ratio/region_mean": clipped}

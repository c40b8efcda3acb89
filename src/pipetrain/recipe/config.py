"""The training recipe's configuration: learning rate and its schedule, weight decay, clipping, the non-finite guard.

Every default of the recipe lives here, in `RecipeConfig`'s fields (the command line reads them from it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipetrain.errors import ConfigError

__all__ = ["LR_SCHEDULES", "WSD_DECAY_FRACTION", "RecipeConfig"]

#: The learning-rate schedules (see `pipetrain.recipe.schedule`).
LR_SCHEDULES = ("constant", "linear", "cosine", "wsd")
#: The share of the run a `wsd` schedule decays over when `decay_steps` is not given (10-20 % is usual:
#: Hu et al. 2024, MiniCPM; Hägele et al. 2024).
WSD_DECAY_FRACTION = 0.2


def _finite(name: str, value: float, *, minimum: float, strict: bool, hint: str) -> None:
    bad = (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
           or value < minimum or (strict and value == minimum))
    if bad:
        what = "a positive" if strict and minimum == 0 else "a non-negative" if minimum == 0 else "a"
        raise ConfigError(f"{name} must be {what} finite number, got {value!r}", hint=hint)


def _count(name: str, value: int | None, *, minimum: int, hint: str) -> None:
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name} must be an integer of {minimum} or more, got {value!r}", hint=hint)


@dataclass(frozen=True, kw_only=True)
class RecipeConfig:
    """How each optimizer step is made (`pipetrain train --lr ... --lr-schedule ... --grad-clip ...`).

    `lr` is the peak learning rate; `lr_schedule` one of `LR_SCHEDULES`, after `warmup_steps` of linear
    warm-up, down to `min_lr` (`wsd`: constant, then a linear decay over the last `decay_steps`, by default
    `WSD_DECAY_FRACTION` of the run). `weight_decay` (AdamW's, decoupled) applies to matrices only, never to
    biases, norm weights or embeddings. `grad_clip`: the maximum global L2 norm of the gradients (None: no
    clipping). `skip_nonfinite`: how many steps with a non-finite loss or gradient norm are skipped (no
    optimizer step) before the job stops; 0 stops at the first.
    """

    lr: float = 1e-3
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    min_lr: float = 0.0
    decay_steps: int | None = None
    weight_decay: float = 0.01
    grad_clip: float | None = None
    skip_nonfinite: int = 0

    def __post_init__(self) -> None:
        _finite("learning rate (--lr)", self.lr, minimum=0, strict=True, hint="pass e.g. --lr 1e-3")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(f"unknown LR schedule (--lr-schedule) {self.lr_schedule!r}",
                              hint=f"choose one of: {', '.join(LR_SCHEDULES)}")
        _count("--warmup-steps", self.warmup_steps, minimum=0, hint="pass --warmup-steps 0 or more")
        _finite("--min-lr", self.min_lr, minimum=0, strict=False, hint="pass --min-lr 0 or more, below --lr")
        if self.min_lr > self.lr:
            raise ConfigError(f"--min-lr {self.min_lr:g} is above the peak learning rate --lr {self.lr:g}",
                              hint="pass a --min-lr below --lr (e.g. a tenth of it)")
        if self.min_lr and self.lr_schedule == "constant":
            raise ConfigError(f"--min-lr {self.min_lr:g} has no effect with the constant LR schedule",
                              hint="pass --lr-schedule linear, cosine or wsd, or drop --min-lr")
        _count("--decay-steps", self.decay_steps, minimum=1, hint="pass --decay-steps 1 or more")
        if self.decay_steps is not None and self.lr_schedule != "wsd":
            raise ConfigError(f"--decay-steps {self.decay_steps} sets the decay of the wsd schedule, not of "
                              f"{self.lr_schedule!r}", hint="pass --lr-schedule wsd, or drop --decay-steps")
        _finite("--weight-decay", self.weight_decay, minimum=0, strict=False,
                hint="pass --weight-decay 0 (none) or more, e.g. 0.1")
        if self.grad_clip is not None:
            _finite("--grad-clip", self.grad_clip, minimum=0, strict=True,
                    hint="pass a positive maximum gradient norm, e.g. --grad-clip 1.0, or omit it for no clipping")
        _count("--skip-nonfinite", self.skip_nonfinite, minimum=0, hint="pass --skip-nonfinite 0 or more")

    def wsd_decay_steps(self, total_steps: int) -> int:
        """The steps a `wsd` schedule decays over in a run of `total_steps` (given, or its default share)."""
        if self.decay_steps is not None:
            return self.decay_steps
        return min(max(1, round(WSD_DECAY_FRACTION * total_steps)), max(1, total_steps - self.warmup_steps))

    def check_run(self, total_steps: int) -> None:
        """Raise ConfigError when the schedule does not fit a run of `total_steps` optimizer steps."""
        if self.warmup_steps > total_steps:
            raise ConfigError(f"--warmup-steps {self.warmup_steps} is longer than the run, {total_steps} step(s)",
                              hint=f"pass --warmup-steps {total_steps} or fewer (a tenth of the run is usual), "
                                   "or train longer (--epochs, --max-steps)")
        if self.lr_schedule == "wsd":
            decay = self.wsd_decay_steps(total_steps)
            if self.warmup_steps + decay > total_steps:
                raise ConfigError(f"--warmup-steps {self.warmup_steps} and --decay-steps {decay} add up to more "
                                  f"than the run, {total_steps} step(s)",
                                  hint=f"pass --decay-steps {max(1, total_steps - self.warmup_steps)} or fewer, or "
                                       "fewer --warmup-steps")

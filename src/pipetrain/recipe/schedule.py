"""Learning-rate schedules as pure functions of the optimizer step (no torch, no state to checkpoint).

A schedule gives the learning rate of step `s` (0-based: `s` steps are done before it) of a run of `T`
steps. Warm-up: steps `0 .. W-1` ramp linearly, `lr * (s + 1) / W`, so the first step already learns and
step `W-1` is at the peak. After it the progress is `p = (s - W) / (T - W)`, from 0 at step `W` to 1 at step
`T`, one past the last step (so no step is spent at `min_lr` exactly, and linear-to-zero wastes none):

- `constant`: the peak `lr` throughout;
- `linear`:   `min_lr + (lr - min_lr) * (1 - p)`;
- `cosine`:   `min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2`;
- `wsd` (warm-up, stable, decay): the peak until the last `D` steps, then linear to `min_lr` over them:
  `q = (s - (T - D)) / D` in place of `p`.

Because the rate depends on the step alone, a resumed job (under any layout) gets it back from the step
counter of its checkpoint; nothing else is saved.
"""

from __future__ import annotations

import math

from pipetrain.recipe.config import RecipeConfig

__all__ = ["lr_at", "remaining"]


def remaining(schedule: str, step: int, *, total_steps: int, warmup_steps: int = 0, decay_steps: int = 1) -> float:
    """How much of the way from `min_lr` up to the peak the rate is at `step`, after the warm-up: 1 at the
    peak, 0 at `min_lr` (`decay_steps` is used by `wsd` only). Steps past `total_steps` stay at the end."""
    if schedule == "constant":
        return 1.0
    step = min(step, total_steps)
    if schedule == "wsd":
        start = total_steps - decay_steps
        return 1.0 if step < start else 1.0 - (step - start) / decay_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    if schedule == "linear":
        return 1.0 - progress
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown LR schedule {schedule!r}")


def lr_at(config: RecipeConfig, step: int, total_steps: int) -> float:
    """The learning rate of `step` (0-based) of a run of `total_steps` optimizer steps under `config`."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    left = remaining(config.lr_schedule, step, total_steps=total_steps, warmup_steps=config.warmup_steps,
                     decay_steps=config.wsd_decay_steps(total_steps))
    return config.min_lr + (config.lr - config.min_lr) * left

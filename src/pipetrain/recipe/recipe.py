"""`Recipe`: what any training loop calls once per step, after the backward: guard, clip, set the LR, update."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.pipeline import PipelineEngine, StepResult
from pipetrain.recipe.clip import clip_grads_with_norm_, grad_norm
from pipetrain.recipe.config import RecipeConfig
from pipetrain.recipe.guard import NonFiniteGuard
from pipetrain.recipe.schedule import lr_at

__all__ = ["StepOutcome", "Recipe"]

log = logging.getLogger("pipetrain")


@dataclass(frozen=True)
class StepOutcome:
    """What one call of `Recipe.step` did (the same on every rank): the learning rate of the step, the global
    gradient norm before clipping, whether clipping scaled the gradients, whether the step was skipped (a
    non-finite loss or norm: no update), and how many steps the run has skipped so far."""

    lr: float
    grad_norm: float
    clipped: bool
    skipped: bool
    skipped_total: int


class Recipe:
    """One step of the recipe over `engine`'s gradients (or a `Session`'s engine), `total_steps` in the run.

    The loop runs the forward and backward (`engine.step`), then `recipe.step(step, result)` with `step` the
    number of optimizer steps done before (0-based, the checkpoints' `Position.step`). It computes the global
    gradient norm, stops (`NonFiniteError`) or skips the step when the loss or the norm is not finite, clips
    to `config.grad_clip`, sets every parameter group's `lr` to the schedule's value at `step`, and steps the
    optimizer. A skipped step zeroes the gradients and does not update, but its step still counts: the
    schedule goes on as planned (the rate is a function of the step alone). `state_dict()` is what a
    checkpoint keeps (the skipped count); the LR needs nothing but the step. `save_dir`: where the job's
    checkpoints are, named in the divergence message.
    """

    def __init__(self, config: RecipeConfig, optimizer: torch.optim.Optimizer, model: Any, total_steps: int, *,
                 save_dir: Path | None = None, norm_type: float = 2.0) -> None:
        config.check_run(total_steps)
        self.config = config
        self.optimizer = optimizer
        self.engine: PipelineEngine = getattr(model, "engine", model)
        self.total_steps = total_steps
        self.norm_type = norm_type
        self.guard = NonFiniteGuard(config.skip_nonfinite, save_dir=save_dir)

    def lr_at(self, step: int) -> float:
        """The learning rate of `step` (0-based)."""
        return lr_at(self.config, step, self.total_steps)

    def step(self, step: int, result: StepResult | float) -> StepOutcome:
        """Guard, clip, set the LR and step the optimizer for step `step` whose forward and backward gave
        `result` (or its global loss). A collective call (the gradient norm): every rank calls it."""
        loss = result.loss if isinstance(result, StepResult) else float(result)
        norm = grad_norm(self.engine, self.norm_type)
        lr = self.lr_at(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.guard.check(step, loss, norm):
            self.optimizer.zero_grad(set_to_none=True)
            return StepOutcome(lr, norm, clipped=False, skipped=True, skipped_total=self.guard.skipped)
        max_norm = self.config.grad_clip
        clipped = max_norm is not None and norm > max_norm
        if max_norm is not None:
            clip_grads_with_norm_(self.engine, max_norm, norm)
        self.optimizer.step()
        return StepOutcome(lr, norm, clipped=clipped, skipped=False, skipped_total=self.guard.skipped)

    def state_dict(self) -> dict[str, Any]:
        """The recipe's state to checkpoint (JSON data)."""
        return {"skipped": self.guard.skipped, "total_steps": self.total_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` (an empty dict: a fresh run, or a checkpoint from before the recipe)."""
        self.guard.skipped = int(state.get("skipped", 0))
        saved_total = state.get("total_steps")
        if saved_total is not None and saved_total != self.total_steps and _is_main():
            log.warning("pipetrain: the LR schedule now spans %d steps, %d when the checkpoint was saved: the "
                        "learning rate follows the new schedule from here", self.total_steps, saved_total)


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0

"""The training recipe: LR schedules, weight-decay groups, global gradient clipping and the non-finite guard.

For a loop you own (every rank runs it)::

    from pipetrain.recipe import Recipe, RecipeConfig, build_optimizer
    config = RecipeConfig(lr=3e-4, lr_schedule="cosine", warmup_steps=100, grad_clip=1.0)
    optimizer = build_optimizer(session.engine, config.lr, config.weight_decay)
    recipe = Recipe(config, optimizer, session, total_steps=steps)
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        result = session.engine.step(x, y)
        outcome = recipe.step(step, result)        # lr, grad_norm, clipped, skipped, skipped_total
"""

from typing import TYPE_CHECKING

from pipetrain.lazy import lazy_exports

#: public name -> the module that defines it (loaded on first use: `RecipeConfig` needs no torch)
_EXPORTS = {
    **dict.fromkeys(("clip_grad_norm_", "clip_grads_with_norm_", "grad_norm"), "pipetrain.recipe.clip"),
    **dict.fromkeys(("LR_SCHEDULES", "WSD_DECAY_FRACTION", "RecipeConfig"), "pipetrain.recipe.config"),
    **dict.fromkeys(("build_optimizer", "decays", "no_decay_names", "param_groups"), "pipetrain.recipe.groups"),
    "NonFiniteGuard": "pipetrain.recipe.guard",
    **dict.fromkeys(("Recipe", "StepOutcome"), "pipetrain.recipe.recipe"),
    **dict.fromkeys(("lr_at", "remaining"), "pipetrain.recipe.schedule"),
}

__all__ = [
    "LR_SCHEDULES",
    "WSD_DECAY_FRACTION",
    "RecipeConfig",
    "Recipe",
    "StepOutcome",
    "NonFiniteGuard",
    "build_optimizer",
    "param_groups",
    "no_decay_names",
    "decays",
    "grad_norm",
    "clip_grad_norm_",
    "clip_grads_with_norm_",
    "lr_at",
    "remaining",
]

if TYPE_CHECKING:
    from pipetrain.recipe.clip import clip_grad_norm_, clip_grads_with_norm_, grad_norm
    from pipetrain.recipe.config import LR_SCHEDULES, WSD_DECAY_FRACTION, RecipeConfig
    from pipetrain.recipe.groups import build_optimizer, decays, no_decay_names, param_groups
    from pipetrain.recipe.guard import NonFiniteGuard
    from pipetrain.recipe.recipe import Recipe, StepOutcome
    from pipetrain.recipe.schedule import lr_at, remaining

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

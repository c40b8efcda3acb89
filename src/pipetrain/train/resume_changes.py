"""What a resumed job changed of the recipe its checkpoint was saved with (`--lr`, the schedule, the batch size,
the run's length): one warning line on rank 0, since the values given now apply, silently otherwise."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from pipetrain.recipe import RecipeConfig

__all__ = ["RUN_FIELDS", "recipe_changes", "changes_warning"]

#: The job's own fields (besides `RecipeConfig`'s) that shape the recipe: the global batch and the run's length
#: (which the LR schedule spans).
RUN_FIELDS = ("batch_size", "epochs", "max_steps")


def _text(value: Any) -> str:
    return "none" if value is None else str(value)


def recipe_changes(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """`--flag old -> new` for each recipe field whose value in the job configuration `now` differs from `saved`
    (both as `TrainConfig.as_json()`, the checkpoint's `job_config`); a field missing from either (a checkpoint
    from an older version) is not compared."""
    places = [((), name) for name in RUN_FIELDS] + [(("recipe",), field.name) for field in fields(RecipeConfig)]
    changes = []
    for path, name in places:
        old, new = saved, now
        for key in path:
            old, new = old.get(key) or {}, new.get(key) or {}
        if name in old and name in new and old[name] != new[name]:
            changes.append(f"--{name.replace('_', '-')} {_text(old[name])} -> {_text(new[name])}")
    return changes


def changes_warning(changes: list[str]) -> str:
    """The one line a resumed job says of its `changes` (`recipe_changes`)."""
    return (f"pipetrain: warning: resumed with another recipe than the checkpoint's: {', '.join(changes)} (the new "
            "values apply from here; pass the old ones to keep them)")

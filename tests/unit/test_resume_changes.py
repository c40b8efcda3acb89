"""A resumed job's recipe against its checkpoint's (`recipe_changes`): each changed field named, old -> new, in one
line; the same recipe, or a field an older checkpoint lacks, says nothing."""

from __future__ import annotations

from dataclasses import replace

from pipetrain.recipe import RecipeConfig
from pipetrain.train.config import TrainConfig
from pipetrain.train.resume_changes import changes_warning, recipe_changes


def _job(**changes) -> dict:
    recipe = {key: changes.pop(key) for key in list(changes) if key in RecipeConfig.__dataclass_fields__}
    config = TrainConfig(preset="tiny", batch_size=16, max_steps=100, recipe=RecipeConfig(**{"lr": 2e-4, **recipe}))
    return replace(config, **changes).as_json()


def test_the_same_recipe_says_nothing():
    assert recipe_changes(_job(), _job()) == []
    assert recipe_changes(_job(), _job(seed=3, epochs=None)) == []  # the seed is not the recipe


def test_each_changed_field_is_named_old_to_new():
    saved, now = _job(), _job(lr=1e-3, lr_schedule="cosine", warmup_steps=10, weight_decay=0.1, grad_clip=1.0,
                              batch_size=32, max_steps=200)
    assert recipe_changes(saved, now) == ["--batch-size 16 -> 32", "--max-steps 100 -> 200", "--lr 0.0002 -> 0.001",
                                          "--lr-schedule constant -> cosine", "--warmup-steps 0 -> 10",
                                          "--weight-decay 0.01 -> 0.1", "--grad-clip none -> 1.0"]
    line = changes_warning(recipe_changes(saved, _job(lr=1e-3)))
    assert line.startswith("pipetrain: warning: ") and "--lr 0.0002 -> 0.001" in line and "\n" not in line


def test_a_field_an_older_checkpoint_lacks_is_not_compared():
    saved = _job()
    del saved["recipe"]["warmup_steps"], saved["max_steps"]
    assert recipe_changes(saved, _job(warmup_steps=5, max_steps=50)) == []
    assert recipe_changes({}, _job(lr=1.0)) == []

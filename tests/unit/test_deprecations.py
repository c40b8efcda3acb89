"""Old names of the public API keep working for a release, with a DeprecationWarning (no process group)."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from pipetrain.recipe import RecipeConfig
from pipetrain.trainer import TrainConfig


def test_train_config_lr_is_the_deprecated_spelling_of_the_recipe_lr():
    with pytest.warns(DeprecationWarning, match=r"recipe=RecipeConfig\(lr=\.\.\.\)"):
        old = TrainConfig(preset="tiny", lr=0.25)
    assert old.recipe == RecipeConfig(lr=0.25) and old.lr == 0.25
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new spelling and replace() warn nothing
        new = TrainConfig(preset="tiny", recipe=RecipeConfig(lr=0.25))
        assert new == old and new.lr == 0.25
        assert dataclasses.replace(old, recipe=RecipeConfig(lr=0.5)).lr == 0.5  # replace keeps the new recipe
    assert "lr" not in old.as_json()  # the checkpoint's job config has it once, under recipe

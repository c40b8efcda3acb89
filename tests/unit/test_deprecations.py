"""Old names of the public API keep working for a release, with a DeprecationWarning (no process group)."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from pipetrain.recipe import RecipeConfig
from pipetrain.train.loop import TrainConfig


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


@pytest.mark.parametrize("old,new", sorted(__import__("pipetrain.moved", fromlist=["MOVED"]).MOVED.items()))
def test_a_moved_module_imports_from_its_old_path_with_a_warning(old, new):
    """Each import path of 0.1 that moved in 0.2 gives the same module, and says where it went."""
    import importlib
    import sys

    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)


def test_old_names_of_the_classifier_module_and_run_as_a_script(tmp_path):
    """`pipetrain.workloads.classifier` became a package: its old names still import, with a warning; and
    `python -m` on an old path runs the new module (here: `pipetrain.plan.tp_table`'s message that it moved)."""
    import subprocess
    import sys

    from pipetrain.workloads.classifier.workload import REAL_EPOCHS, ClassifierWorkload

    with pytest.warns(DeprecationWarning, match="classifier.workload"):
        from pipetrain.workloads.classifier import ClassifierWorkload as old
    assert old is ClassifierWorkload and REAL_EPOCHS >= 1
    done = subprocess.run([sys.executable, "-W", "always", "-m", "pipetrain.trainer"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "pipetrain.trainer moved to pipetrain.train.loop" in done.stderr

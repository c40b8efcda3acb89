"""The training recipe without processes: LR schedules at known steps, config validation, the guard, groups, flags."""

from __future__ import annotations

import argparse
import math

import pytest
import torch
from torch import nn

from pipetrain.cli.recipe_args import add_recipe_arguments, recipe_config
from pipetrain.errors import ConfigError, NonFiniteError
from pipetrain.recipe import (
    WSD_DECAY_FRACTION,
    NonFiniteGuard,
    RecipeConfig,
    build_optimizer,
    lr_at,
    no_decay_names,
    param_groups,
)


def _lrs(config: RecipeConfig, total: int) -> list[float]:
    return [lr_at(config, step, total) for step in range(total + 1)]  # step `total` is one past the last


def test_constant_is_the_peak_after_its_warmup():
    assert _lrs(RecipeConfig(lr=0.1), 5) == [0.1] * 6
    lrs = _lrs(RecipeConfig(lr=1.0, warmup_steps=4), 8)
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]  # the first step already learns, the last warm-up step is the peak
    assert lrs[4:] == [1.0] * 5


def test_linear_decays_from_the_peak_to_min_lr_one_past_the_last_step():
    lrs = _lrs(RecipeConfig(lr=1.0, lr_schedule="linear", warmup_steps=2, min_lr=0.2), 10)
    assert lrs[:3] == [0.5, 1.0, 1.0]
    assert lrs[2:] == pytest.approx([0.2 + 0.8 * (1 - k / 8) for k in range(9)])
    assert lrs[-1] == pytest.approx(0.2) and lrs[-2] > 0.2  # no step is spent at min_lr
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))


def test_linear_to_zero_without_warmup():
    assert _lrs(RecipeConfig(lr=1.0, lr_schedule="linear"), 4) == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])


def test_cosine_values_and_floor():
    config = RecipeConfig(lr=1.0, lr_schedule="cosine", warmup_steps=2, min_lr=0.1)
    lrs = _lrs(config, 10)
    assert lrs[:2] == [0.5, 1.0]
    assert lrs[2] == pytest.approx(1.0)
    assert lrs[6] == pytest.approx(0.55)  # half-way through the decay: the mean of peak and floor
    assert lrs[4] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lrs[10] == pytest.approx(0.1)
    assert min(lrs) >= 0.1 - 1e-12
    assert lr_at(config, 50, 10) == pytest.approx(0.1)  # past the run: stays at the floor


def test_wsd_is_stable_then_decays_over_its_last_steps():
    config = RecipeConfig(lr=2.0, lr_schedule="wsd", warmup_steps=2, decay_steps=4, min_lr=0.0)
    lrs = _lrs(config, 10)
    assert lrs[:2] == [1.0, 2.0]
    assert lrs[2:7] == [2.0] * 5  # the plateau, up to step T - D
    assert lrs[6:] == pytest.approx([2.0, 1.5, 1.0, 0.5, 0.0])


def test_wsd_decays_over_a_fifth_of_the_run_by_default():
    assert WSD_DECAY_FRACTION == 0.2
    config = RecipeConfig(lr=1.0, lr_schedule="wsd", min_lr=0.1)
    assert config.wsd_decay_steps(100) == 20
    lrs = _lrs(config, 100)
    assert lrs[:81] == [1.0] * 81 and lrs[81] < 1.0 and lrs[100] == pytest.approx(0.1)
    assert config.wsd_decay_steps(3) == 1  # at least one step


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"lr": float("nan")}, "learning rate (--lr) must be a positive finite number, got nan"),
        ({"lr": float("inf")}, "got inf"),
        ({"lr": 0.0}, "got 0.0"),
        ({"lr": -1.0}, "got -1.0"),
        ({"lr_schedule": "step"}, "unknown LR schedule (--lr-schedule) 'step'"),
        ({"warmup_steps": -1}, "--warmup-steps must be an integer of 0 or more"),
        ({"lr_schedule": "cosine", "min_lr": 1.0}, "--min-lr 1 is above the peak learning rate"),
        ({"lr_schedule": "cosine", "min_lr": float("nan")}, "--min-lr must be a non-negative finite number"),
        ({"min_lr": 1e-5}, "no effect with the constant LR schedule"),
        ({"decay_steps": 5}, "sets the decay of the wsd schedule, not of 'constant'"),
        ({"lr_schedule": "wsd", "decay_steps": 0}, "--decay-steps must be an integer of 1 or more"),
        ({"weight_decay": -0.1}, "--weight-decay must be a non-negative finite number, got -0.1"),
        ({"grad_clip": 0.0}, "--grad-clip must be a positive finite number, got 0.0"),
        ({"grad_clip": float("inf")}, "--grad-clip must be a positive finite number, got inf"),
        ({"skip_nonfinite": -1}, "--skip-nonfinite must be an integer of 0 or more"),
    ],
)
def test_bad_values_are_refused_with_a_hint(kwargs, expected):
    with pytest.raises(ConfigError) as info:
        RecipeConfig(**kwargs)
    assert expected in str(info.value) and info.value.hint


def test_the_schedule_must_fit_the_run():
    RecipeConfig(warmup_steps=10).check_run(10)
    with pytest.raises(ConfigError, match="--warmup-steps 11 is longer than the run, 10 step"):
        RecipeConfig(warmup_steps=11).check_run(10)
    with pytest.raises(ConfigError, match="--warmup-steps 4 and --decay-steps 7 add up to more than the run"):
        RecipeConfig(lr_schedule="wsd", warmup_steps=4, decay_steps=7).check_run(10)
    RecipeConfig(lr_schedule="wsd", warmup_steps=4, decay_steps=6).check_run(10)


def test_flags_make_the_config_and_default_to_it():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=RecipeConfig.lr)
    add_recipe_arguments(parser)
    assert recipe_config(parser.parse_args([])) == RecipeConfig()
    args = parser.parse_args(["--lr", "3e-4", "--lr-schedule", "wsd", "--warmup-steps", "5", "--min-lr", "1e-5",
                              "--decay-steps", "7", "--weight-decay", "0.1", "--grad-clip", "1", "--skip-nonfinite", "2"])
    assert recipe_config(args) == RecipeConfig(lr=3e-4, lr_schedule="wsd", warmup_steps=5, min_lr=1e-5, decay_steps=7,
                                               weight_decay=0.1, grad_clip=1.0, skip_nonfinite=2)


def test_defaults_are_today_s_behaviour():
    config = RecipeConfig()
    assert (config.lr, config.lr_schedule, config.warmup_steps, config.grad_clip, config.skip_nonfinite) == (
        1e-3, "constant", 0, None, 0)
    assert config.weight_decay == torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).defaults["weight_decay"]


def test_guard_stops_at_the_first_non_finite_step_and_names_it(tmp_path):
    guard = NonFiniteGuard()
    assert guard.check(0, 0.7, 1.5) is False
    with pytest.raises(NonFiniteError) as info:
        guard.check(6, float("nan"), 2.0)
    assert "training diverged at step 7 (loss nan, gradient norm 2)" in str(info.value)
    assert "before its optimizer step" in str(info.value)
    with pytest.raises(NonFiniteError, match=f"no checkpoint in '{tmp_path}' yet"):
        NonFiniteGuard(save_dir=tmp_path).check(0, 1.0, float("inf"))
    (tmp_path / "step-00000004").mkdir()
    (tmp_path / "step-00000004" / "pipetrain.json").write_text("{}")
    with pytest.raises(NonFiniteError, match="the last complete checkpoint is '.*step-00000004'"):
        NonFiniteGuard(save_dir=tmp_path).check(5, float("inf"), float("nan"))


def test_guard_skips_up_to_n_steps_then_stops():
    guard = NonFiniteGuard(2)
    assert [guard.check(s, v, 1.0) for s, v in enumerate([1.0, math.inf, 1.0, math.nan])] == [False, True, False, True]
    assert guard.skipped == 2
    with pytest.raises(NonFiniteError, match=r"2 such step\(s\) skipped before \(--skip-nonfinite 2\)"):
        guard.check(4, 1.0, math.nan)


def test_no_decay_on_biases_norms_and_embeddings():
    model = nn.Sequential(nn.Embedding(10, 4), nn.LayerNorm(4), nn.Linear(4, 4),
                          nn.TransformerEncoderLayer(4, 2, 8, batch_first=True))
    assert no_decay_names(model) == {
        "0.weight", "1.weight", "1.bias", "2.bias", "3.self_attn.in_proj_bias", "3.self_attn.out_proj.bias",
        "3.linear1.bias", "3.linear2.bias", "3.norm1.weight", "3.norm1.bias", "3.norm2.weight", "3.norm2.bias"}
    groups = param_groups(model, 0.1)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    optimizer = build_optimizer(model, 0.01, 0.1)
    assert [(g["lr"], g["weight_decay"]) for g in optimizer.param_groups] == [(0.01, 0.1), (0.01, 0.0)]


def test_an_empty_group_is_left_out_and_shared_parameters_counted_once():
    norm = nn.LayerNorm(4)
    assert [g["weight_decay"] for g in param_groups(norm, 0.1)] == [0.0]
    shared = nn.Linear(4, 4)
    groups = param_groups(nn.Sequential(shared, nn.ReLU(), shared), 0.1)
    assert [len(g["params"]) for g in groups] == [1, 1]

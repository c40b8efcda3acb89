"""The fixed costs of a step (`pipetrain.plan.overheads`, `Device.step_overhead_s`): the fit recovers the per-action
and per-step costs a simulated pair of steps was built with, clamps what noise makes negative, the planner adds the
per-step cost once to every layout, and the calibration file keeps it (an old file without it reads 0)."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import pytest

from pipetrain.errors import ConfigError
from pipetrain.plan.hardware import (DEFAULT_NETWORK, Calibration, Device, default_device, load_calibration,
                                     save_calibration)
from pipetrain.plan.model import config_blocks
from pipetrain.plan.overheads import StepSample, fit_overheads
from pipetrain.plan.predict import Layout, predict
from pipetrain.plan.schedules import schedule_order
from pipetrain.plan.simulate import StageCost, simulate
from pipetrain.workloads.classifier.presets import PRESETS

ACTION_S, STEP_S = 2.5e-3, 0.04


def _sample(chunks: int) -> StepSample:
    """A 2-stage GPipe step of `chunks` micro-batches as the calibration's, 'measured' with the costs above."""
    stage = StageCost(forward_s=0.02 / chunks, backward_s=0.04 / chunks, send_s=1e-4)
    order = schedule_order("gpipe", 2, chunks)
    bare, paying = simulate(order, [stage, stage]).span_s, simulate(order, [stage, stage], overhead_s=1.0).span_s
    actions = paying - bare
    measured = simulate(order, [stage, stage], overhead_s=ACTION_S).span_s + STEP_S
    return StepSample(measured, bare, actions)


def test_the_fit_recovers_both_costs():
    few, many = _sample(1), _sample(16)
    assert many.actions > few.actions  # more micro-batches, more actions on the critical path
    assert fit_overheads(few, many) == pytest.approx((ACTION_S, STEP_S), rel=1e-9)


def test_noise_never_gives_a_negative_cost():
    few = StepSample(measured_s=0.10, span_s=0.05, actions=4)
    assert fit_overheads(few, StepSample(measured_s=0.09, span_s=0.05, actions=34)) == pytest.approx((0.0, 0.04))
    assert fit_overheads(few, StepSample(measured_s=0.50, span_s=0.05, actions=34)) == pytest.approx((0.45 / 34, 0.0))
    with pytest.raises(ConfigError, match="no per-action cost to fit"):
        fit_overheads(few, few)


@pytest.mark.parametrize("pp, chunks, schedule", [(1, 1, "gpipe"), (2, 4, "1f1b"), (4, 8, "1f1b")])
def test_the_planner_adds_the_step_cost_once_whatever_the_layout(pp, chunks, schedule):
    blocks = config_blocks(PRESETS["tiny"])
    layout = Layout(dp=1, pp=pp, batch=32, chunks=chunks, schedule=schedule)
    device = default_device()
    base = predict(blocks, layout, device, DEFAULT_NETWORK).step_s
    more = predict(blocks, layout, replace(device, step_overhead_s=STEP_S), DEFAULT_NETWORK).step_s
    assert more - base == pytest.approx(STEP_S, rel=1e-9)


def test_the_calibration_file_keeps_it_and_an_old_one_reads_zero(tmp_path):
    device = replace(default_device(), step_overhead_s=STEP_S)
    calibration = Calibration(device=device, network=DEFAULT_NETWORK, backend="gloo", measured="now")
    save_calibration(calibration, tmp_path / "c.json")
    assert load_calibration(tmp_path / "c.json").device.step_overhead_s == STEP_S
    data = json.loads((tmp_path / "c.json").read_text())
    del data["device"]["step_overhead_s"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert load_calibration(tmp_path / "old.json").device == replace(device, step_overhead_s=0.0)
    assert set(asdict(device)) >= {"action_overhead_s", "step_overhead_s"}

"""Calibration on 2 real gloo ranks: every figure measured, positive and finite, and the file round-trips."""

from __future__ import annotations

import math
from dataclasses import asdict

from pipetrain.bench.calibrate import calibrate
from pipetrain.plan.hardware import load_calibration, save_calibration


def test_calibration_measures_every_figure(tmp_path):
    measured = calibrate(dict(seq_len=8, emsize=16, nhead=2, nhid=32), samples=4, repeats=2, timeout_s=240)
    # differences of two timings, clamped at 0 when noise hides them; the rest is measured and positive
    clamped = ("kernel_overhead_s", "action_overhead_s", "optimizer_s_per_tensor", "contention", "pipeline_slowdown",
               "tp_collective_s", "fsdp_group_s", "optimizer_s_per_dtensor", "step_overhead_s", "ep_all_to_all_s")
    # collectives across nodes: measured only in a job that spans nodes (bench/internode.py); 0 on one node
    assert (measured.network.inter_collective_latency_s, measured.network.inter_collective_bytes_per_s) == (0.0, 0.0)
    clamped += ("inter_collective_latency_s", "inter_collective_bytes_per_s")
    for name, value in {**asdict(measured.device), **asdict(measured.network)}.items():
        if name == "name":
            continue
        if name == "rate_by_samples":  # one rate per micro-batch size 1, 2, 4
            assert [size for size, _ in value] == [1.0, 2.0, 4.0]
            assert all(math.isfinite(rate) and rate > 0 for _, rate in value)
            continue
        assert isinstance(value, float) and math.isfinite(value), name
        assert value >= 0 if name in clamped else value > 0, name
    assert measured.device.cores >= 1  # a CPU here: the cores the ranks share
    assert measured.backend == "gloo"
    save_calibration(measured, tmp_path / "calibration.json")
    assert load_calibration(tmp_path / "calibration.json") == measured

"""Start-up phases (logs/startup.py) on a fake clock, and the inter-node figures a calibration across nodes stores
(plan/hardware.py `Network.across_collective`, bench/calibrate.py `measured_network`), as the planner prices them."""

from __future__ import annotations

import logging

import pytest

from pipetrain.bench.calibrate import inter_node_description, measured_network
from pipetrain.logs.records import StepRecord
from pipetrain.logs.startup import PHASES, Startup, StartupSink, process_age_s
from pipetrain.plan.hardware import DEFAULT_NETWORK
from pipetrain.plan.predict import Layout, reduce_s

LOCAL = {"p2p_latency_s": 3e-6, "p2p_bytes_per_s": 4e11, "collective_latency_s": 8e-6, "collective_bytes_per_s": 3e11}
INTER = {"inter_latency_s": 1e-4, "inter_bytes_per_s": 2.4e6, "inter_collective_latency_s": 2e-4,
         "inter_collective_bytes_per_s": 2.0e6, "inter_nodes": 2.0, "inter_largest_bytes": 4 * 2**20}


def test_phases_add_up_and_are_logged_once(caplog):
    now = [100.0]
    startup = Startup(clock=lambda: now[0])
    startup.seconds["imports+data"] = 5.0  # the process's age, fixed for the test
    for name, seconds in (("join", 2.0), ("layout check", 0.5), ("mesh", 0.25), ("stages", 1.0)):
        with startup.phase(name):
            now[0] += seconds
    now[0] += 0.75 + 3.0  # setup, then a first step of 3 s
    sink = StartupSink(startup)
    record = StepRecord(step=1, epoch=1, loss=1.0, lr=1e-3, samples=8, step_time_s=3.0, samples_per_s=2.7)
    with caplog.at_level(logging.INFO, logger="pipetrain"):
        sink.step(record)
        sink.step(record)
    lines = [r.getMessage() for r in caplog.records if "start-up" in r.getMessage()]
    assert len(lines) == 1
    assert startup.seconds == pytest.approx({"imports+data": 5.0, "join": 2.0, "layout check": 0.5, "mesh": 0.25,
                                             "stages": 1.0, "setup": 0.75, "first step": 3.0})
    assert "12.50 s to the end of the first step" in lines[0]
    assert [name for name in PHASES if name in lines[0]] == list(PHASES)


def test_process_age_is_the_time_since_this_process_started():
    age = process_age_s()
    assert age is None or 0.0 < age < 24 * 3600


def test_measured_inter_node_links_are_stored_and_priced():
    network = measured_network(LOCAL, INTER)
    assert (network.inter_latency_s, network.inter_bytes_per_s) == (1e-4, 2.4e6)
    assert network.across_collective() == (2e-4, 2.0e6)
    assert "2.4 MB/s" in inter_node_description(INTER) and "2 nodes" in inter_node_description(INTER)
    # one node's calibration keeps the built-in figures, its collectives across nodes priced as its p2p ones
    alone = measured_network(LOCAL)
    assert alone.inter_bytes_per_s == DEFAULT_NETWORK.inter_bytes_per_s
    assert alone.across_collective() == (DEFAULT_NETWORK.inter_latency_s, DEFAULT_NETWORK.inter_bytes_per_s)
    # dp across two nodes of one rank: the gradients' ring all-reduce at the measured bus bandwidth
    params = 6.4e6
    across = reduce_s(params, Layout(dp=2, pp=1, batch=8, chunks=1, gpus_per_node=1), network)
    assert across == pytest.approx(params / 2.0e6 + 2 * 2e-4)
    inside = reduce_s(params, Layout(dp=2, pp=1, batch=8, chunks=1, gpus_per_node=2), network)
    assert inside == pytest.approx(params / 3e11 + 2 * 8e-6)

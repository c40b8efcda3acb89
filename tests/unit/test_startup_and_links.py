"""Start-up phases (logs/startup.py) on a fake clock, and the inter-node figures a calibration across nodes stores
(plan/hardware.py `Network.across_collective`, bench/calibrate.py `measured_network`), as the planner prices them."""

from __future__ import annotations

import logging
import os
import time

import pytest

from pipetrain.bench.calibrate import inter_node_description, measured_network
from pipetrain.launch.ranks import launch_start_s, mark_command_start
from pipetrain.logs.records import StepRecord
from pipetrain.logs.startup import PHASES, Startup, StartupSink, process_age_s, process_start_s
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


def test_a_forked_rank_counts_its_start_up_from_its_launchers_start():
    start = process_start_s()
    if start is None:
        pytest.skip("no /proc here")
    startup = Startup(started_at=start - 30.0)  # a launcher that started 30 s before this process
    assert startup.seconds["imports+data"] == pytest.approx(process_age_s() + 30.0, abs=1.0)


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


def _plan_args(tmp_path, *extra: str):
    from pipetrain.cli.main import build_parser

    return build_parser().parse_args(["plan", "--calibrate", "--gpus", "2", "--gpus-per-node", "1", "--calibration",
                                      str(tmp_path / "cal.json"), *extra])


@pytest.mark.parametrize("rank", [0, 1])
def test_calibrate_in_a_job_across_nodes_measures_the_link_then_rank_0_its_node(monkeypatch, tmp_path, capsys, rank):
    """Under torchrun across 2 nodes: every rank measures the link; rank 0 calibrates its node with those figures
    and plans, without the launcher's variables (its two spawned ranks are a job of their own); rank 1 ends."""
    import pipetrain.bench.calibrate as calibrate_mod
    import pipetrain.bench.internode as internode
    from pipetrain.cli import plan
    from pipetrain.plan.hardware import Calibration, Device

    env = {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(rank),
           "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "10.213.7.1", "MASTER_PORT": "29500",
           "TORCHELASTIC_USE_AGENT_STORE": "True"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    measured, seen = [], {}
    monkeypatch.setattr(internode, "measure_inter_node", lambda e, **kw: measured.append(e.rank) or
                        (INTER if e.rank == 0 else None))

    def fake_calibrate(shape, **kwargs):
        seen["inter"], seen["agent_store"] = kwargs["inter"], os.environ.get("TORCHELASTIC_USE_AGENT_STORE")
        device = Device(name="cpu", flops_per_s=5e9, bytes_per_s=1e10, kernel_overhead_s=1e-5, action_overhead_s=1e-3,
                        optimizer_s_per_param=1e-9, memory_bytes=8 * 2**30)
        return Calibration(device=device, network=measured_network(LOCAL, kwargs["inter"]), backend="gloo",
                           measured="test")

    monkeypatch.setattr(calibrate_mod, "calibrate", fake_calibrate)
    assert plan.run(_plan_args(tmp_path)) == 0
    assert measured == [rank]
    if rank == 0:
        assert seen == {"inter": INTER, "agent_store": None}
        assert (tmp_path / "cal.json").exists() and "best layout" in capsys.readouterr().out
        assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # restored after the calibration
    else:
        assert not seen and not (tmp_path / "cal.json").exists()
        assert "rank 1 measured the link" in capsys.readouterr().out


def test_a_later_command_in_the_same_process_counts_its_start_up_from_its_own_beginning():
    if process_start_s() is None:
        pytest.skip("no /proc here")
    launch_start_s()  # a job launched in this process (as a test session or a notebook does)
    mark_command_start()  # the next command begins
    begun = time.clock_gettime(time.CLOCK_BOOTTIME)
    assert begun - 0.02 <= launch_start_s() <= begun + 1.0
    again = launch_start_s()  # launched again with no new command: it begins then, not at the last command
    assert again >= begun - 0.02 and again > process_start_s()

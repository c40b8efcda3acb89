"""The socket interface of multi-node jobs (launch/netif.py, env.socket_interface_variables) and the naming of lost
ranks (launch/lost.py), as plain data: no process group, no traffic (a UDP connect only picks a route)."""

from __future__ import annotations

import math
import socket
import time

import pytest

from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.errors import LaunchError
from pipetrain.launch.agree import describe_layout, layout_disagreement
from pipetrain.launch import lost, netif
from pipetrain.launch.env import join_timeout, socket_interface_variables
from pipetrain.launch.reach import wait_reachable
from pipetrain.launch.failures import backend_failure, error_text
from pipetrain.launch.lost import report_lost_connection, silent_ranks
from pipetrain.launch.ranks import RankSpec

ROUTES = ("Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"
          "eth1\t0010A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n"
          "eth0\t00000000\t0100A8C0\t0003\t0\t0\t0\t00000000\t0\t0\t0\n")


def test_the_loopback_address_is_held_by_lo_and_routes_through_it():
    assert netif.is_loopback("127.0.0.1") and netif.is_loopback("localhost")
    assert not netif.is_loopback("10.213.7.1") and not netif.is_loopback("no-such-host.invalid")
    assert netif.interface_of_address("127.0.0.1") == "lo"
    assert netif.interface_towards("127.0.0.1") == "lo"
    assert netif.interface_towards("no-such-host.invalid") is None


def test_the_default_route_is_read_from_the_table():
    assert netif.default_route_interface(ROUTES) == "eth0"
    assert netif.default_route_interface(ROUTES.splitlines()[0] + "\n") is None


def test_a_one_node_job_on_loopback_sets_nothing():
    assert socket_interface_variables("127.0.0.1", nodes=1, device_type="cpu", environ={}) == {}


def test_the_interface_towards_rank_0_is_chosen(monkeypatch):
    monkeypatch.setattr(netif, "interface_towards", lambda host: {"10.0.0.1": "ib0"}.get(host))
    assert socket_interface_variables("10.0.0.1", nodes=2, device_type="cpu", environ={}) == {
        "GLOO_SOCKET_IFNAME": "ib0"}
    assert socket_interface_variables("10.0.0.1", nodes=2, device_type="cuda", environ={}) == {
        "GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "ib0"}
    # what the user set stands; a host with no route leaves the backend's choice
    assert socket_interface_variables("10.0.0.1", nodes=2, device_type="cuda",
                                      environ={"NCCL_SOCKET_IFNAME": "eth2"}) == {"GLOO_SOCKET_IFNAME": "ib0"}
    assert socket_interface_variables("10.9.9.9", nodes=2, device_type="cpu", environ={}) == {}


def test_rank_0s_own_name_on_loopback_takes_the_default_route_in_a_multi_node_job(monkeypatch):
    """Debian maps the host name to 127.0.1.1: on rank 0's node, gloo would bind to lo and no node could reach it."""
    monkeypatch.setattr(netif, "default_route_interface", lambda routes=None: "eth0")
    assert socket_interface_variables("127.0.1.1", nodes=2, device_type="cpu", environ={}) == {
        "GLOO_SOCKET_IFNAME": "eth0"}
    monkeypatch.setattr(netif, "default_route_interface", lambda routes=None: None)
    assert socket_interface_variables("127.0.1.1", nodes=2, device_type="cpu", environ={}) == {}


def test_silent_ranks_are_those_whose_heartbeat_did_not_move():
    before = {0: "100.0", 1: "100.5", 2: "99.0"}
    after = {0: "103.0", 1: "103.5", 2: "99.0"}
    assert silent_ranks(before, after, world_size=4, me=0, now=104.0) == {2: 5.0, 3: math.inf}


def test_a_lost_connection_is_found_in_the_cause_of_a_pipelining_error():
    cause = RuntimeError("[pair.cc:537] Read error [10.213.7.2]:60118: Connection reset by peer.")
    try:
        try:
            raise cause
        except RuntimeError as inner:
            raise RuntimeError("Failed to run stage backward: Stage output: ...") from inner
    except RuntimeError as outer:
        wrapped = outer
    assert "Connection reset by peer" in error_text(wrapped)
    known = backend_failure(wrapped, 0)
    assert known is not None and "lost its connection" in str(known)
    other = RuntimeError("shapes do not match")
    assert report_lost_connection(other, RankSpec(0, 0, 2, "127.0.0.1", 1, "cpu"), step_timeout_s=10) is None


def test_the_store_of_a_gone_host_is_said_to_be_gone_within_a_bounded_time(monkeypatch):
    """Nothing listens on the port: the report says rank 0's host is gone (no hang, no traceback)."""
    monkeypatch.setattr(lost, "STORE_TIMEOUT_S", 1.0)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    err = RuntimeError("Connection closed by peer [127.0.0.1]:1234")
    known = report_lost_connection(err, RankSpec(1, 1, 2, "127.0.0.1", port, "cpu"), step_timeout_s=1.0)
    assert known is not None and "does not answer either: the host of rank 0 is gone" in str(known), str(known)


def test_the_interface_variables_the_user_set_are_kept():
    assert socket_interface_variables("10.0.0.1", nodes=2, device_type="cuda", environ={
        "GLOO_SOCKET_IFNAME": "a", "NCCL_SOCKET_IFNAME": "b"}) == {}


def test_an_unreachable_rank_0_is_said_within_the_join_timeout():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(LaunchError, match=rf"cannot reach rank 0's host at 127.0.0.1:{port} \(MASTER_ADDR:MASTER_PORT\) "
                                          r"within 1 s: Connection refused \(hint: start rank 0's node"):
        wait_reachable("127.0.0.1", port, timeout_s=1.0, poll_s=0.2)
    assert time.monotonic() - start < 30  # bounded (generously: a loaded machine)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert wait_reachable("127.0.0.1", server.getsockname()[1], timeout_s=5.0) < 5.0


def test_the_join_timeout_is_read_and_checked():
    assert join_timeout({}) == 120.0 and join_timeout({"PIPETRAIN_JOIN_TIMEOUT": "7.5"}) == 7.5
    with pytest.raises(LaunchError, match=r"PIPETRAIN_JOIN_TIMEOUT='soon' is not a positive number of seconds"):
        join_timeout({"PIPETRAIN_JOIN_TIMEOUT": "soon"})


def test_ranks_started_with_different_layouts_are_grouped_in_one_message():
    a = ParallelConfig(dp=2, pipeline=PipelineConfig(pp=1, schedule="gpipe", n_microbatches=2))
    b = ParallelConfig(dp=1, pipeline=PipelineConfig(pp=2, schedule="gpipe", n_microbatches=2))
    c = ParallelConfig(dp=1, pipeline=PipelineConfig(pp=2, schedule="gpipe", n_microbatches=2, shape_cache=4))
    described = {name: (repr(cfg), describe_layout(cfg)) for name, cfg in (("a", a), ("b", b), ("c", c))}
    assert layout_disagreement([described["a"]] * 3) is None
    assert layout_disagreement([described[k] for k in "aabb"]) == (
        "the ranks of this job were started with different layouts: ranks 0-1: dp=2 (ddp) x pp=1, schedule gpipe, "
        "chunks 2, partition uniform; ranks 2-3: dp=1 (ddp) x pp=2, schedule gpipe, chunks 2, partition uniform")
    # a difference the short words do not show: the full configurations are named
    assert "shape_cache=4" in layout_disagreement([described[k] for k in "bc"])


def test_a_claim_left_by_an_earlier_elastic_round_does_not_silence_the_next_loss():
    """torchrun's agent store outlives a restart: the report claim of the last round's loss is still in it (fails on
    main: the claim was never cleared, and nobody reported the second loss)."""
    from datetime import timedelta

    import torch.distributed as dist

    from pipetrain.launch.watchdog import HEARTBEAT_PREFIX

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    store.set(HEARTBEAT_PREFIX + "1", repr(time.time() - 50))  # rank 1 of this round: gone, its heartbeat stopped
    for left in ("1", f"1 {time.time() - 100!r}"):  # an earlier round's claim (older pipetrain wrote no time)
        store.set("pipetrain/lost/reporter", left)
        store.set("pipetrain/lost/saw/1", left.split()[-1])  # rank 1 saw that loss itself then: not now
        message = lost.lost_ranks_message(me=0, world_size=2, master_addr="127.0.0.1", master_port=store.port,
                                          beat_period_s=0.05)
        assert message is not None and message.startswith("lost rank 1 of 2"), message
    # a claim of this round stands: the second rank to see the loss stays quiet
    assert lost.lost_ranks_message(me=1, world_size=2, master_addr="127.0.0.1", master_port=store.port,
                                   beat_period_s=0.05) is None


def test_a_claim_of_the_last_elastic_round_made_seconds_ago_does_not_silence_this_rounds_loss():
    """A restart can come within seconds of the last loss (a flaky host failing again at once): the claim of
    torchrun's previous round is then still young, and only its round tells it apart (fails on main: the claim
    counted for 30 s whatever the round, and the second loss went unreported)."""
    from datetime import timedelta

    import torch.distributed as dist

    from pipetrain.launch.env import elastic_round
    from pipetrain.launch.watchdog import HEARTBEAT_PREFIX

    assert elastic_round({}) == 0 and elastic_round({"TORCHELASTIC_RESTART_COUNT": "2"}) == 2
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    store.set(HEARTBEAT_PREFIX + "1", repr(time.time() - 50))  # rank 1 of this round: gone, its heartbeat stopped
    ask = dict(world_size=2, master_addr="127.0.0.1", master_port=store.port, beat_period_s=0.05)
    # round 0: rank 1 reported a loss (of rank 0, which never beat) a moment ago: its claim and mark are fresh
    assert lost.lost_ranks_message(me=1, restart_count=0, **ask) is not None
    message = lost.lost_ranks_message(me=0, restart_count=1, **ask)
    assert message is not None and message.startswith("lost rank 1 of 2"), message
    assert lost.lost_ranks_message(me=1, restart_count=1, **ask) is None  # this round's claim stands


def test_the_lost_ranks_hint_under_torchrun_elastic_says_it_restarts_by_itself():
    """Fails on main: it said "run again with --resume" although torchrun restarts the job."""
    from pipetrain.launch.env import elastic_restarts_left

    assert elastic_restarts_left({}) is None
    left = elastic_restarts_left({"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RESTART_COUNT": "1"})
    assert left == 2
    assert lost.lost_hint(left).startswith("torchrun restarts the job by itself (2 restarts left)")
    assert "run again with --resume" not in lost.lost_hint(left)
    assert "no restart left" in lost.lost_hint(0) and "run again with --resume" in lost.lost_hint(None)

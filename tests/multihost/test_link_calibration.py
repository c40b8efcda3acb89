"""The inter-host link as `pipetrain plan --calibrate` measures it in a job across two hosts (bench/internode.py),
checked against the rate the link is shaped to (tbf 20 Mbit/s = 2.5 MB/s): point-to-point and the all-reduce's bus
bandwidth within -40 % / +10 % of it (TCP and gloo's headers take a few per cent; tbf lets no more through)."""

from __future__ import annotations

import json
import sys

import pytest

from scripts.netns_cluster import ADDRESSES, MASTER_PORT, Cluster, environ, netns_problem, wait_all

PROBLEM = netns_problem()
pytestmark = [pytest.mark.multihost, pytest.mark.skipif(PROBLEM is not None, reason=PROBLEM or "")]

RATE_BYTES_PER_S = 20e6 / 8
MEASURE = ("import json, sys; from pipetrain.bench.internode import measure_inter_node; "
           "from pipetrain.launch.env import detect; print('FIGURES', json.dumps(measure_inter_node(detect(), repeats=2)))")


def test_the_calibrated_inter_host_link_is_the_shaped_rate(cluster: Cluster):
    cluster.shape("20mbit")
    common = {"WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0",
              "MASTER_ADDR": ADDRESSES[0], "MASTER_PORT": str(MASTER_PORT)}
    processes = [cluster.start(rank, [sys.executable, "-c", MEASURE], environ(**common, RANK=str(rank),
                                                                                GROUP_RANK=str(rank)),
                               f"rank{rank}.log") for rank in (0, 1)]
    codes = wait_all(processes, 180.0)
    outputs = [cluster.output(f"rank{rank}.log") for rank in (0, 1)]
    assert codes == [0, 0], "\n".join(outputs)
    lines = [line for line in outputs[0].splitlines() if line.startswith("FIGURES ")]
    figures = json.loads(lines[-1].split(" ", 1)[1])
    assert "FIGURES null" in outputs[1]  # rank 1 measures with rank 0; the figures are rank 0's
    for name in ("inter_bytes_per_s", "inter_collective_bytes_per_s"):
        assert 0.6 * RATE_BYTES_PER_S <= figures[name] <= 1.1 * RATE_BYTES_PER_S, (name, figures)
    assert figures["inter_nodes"] == 2.0
    assert figures["inter_largest_bytes"] <= 4 * 2**20  # sizes stopped growing once a transfer took 0.25 s
    left = {cluster.host(i): cluster.pids(i) for i in (0, 1)}
    assert not any(left.values()), f"processes left behind: {left}"

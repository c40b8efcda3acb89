"""Jobs across two hosts (network namespaces joined by a veth pair, scripts/netns-cluster.sh): dp2 x pp2 with the
pipeline inside each host (torchrun, c10d rendezvous) and across the hosts on a throttled link (the ranks' variables
set by hand), each equal in losses to a one-process run; a host killed at once, and the link taken down mid-step,
each named in one message; --resume after the kill continues with the uninterrupted run's losses.

The one-process runs (the reference, the resumes) run on this host, in the test process itself: only their rank
starts (an interpreter fewer than `python -m pipetrain` each).

Parity tolerance: 5e-5 absolute on every step's loss (DDP's all-reduce and the micro-batch mean sum in another
order than the one process does). Time bounds are generous (two shared cores): they catch hangs, not slowness.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipetrain.cli.main import main
from scripts.netns_cluster import (ADDRESSES, MASTER_PORT, Cluster, environ, losses, netns_problem, torchrun,
                                     wait_all, wait_for)
from tests.multihost.test_elastic import JOB, STEPS  # the tier's one job: conftest's `reference` is its losses

PROBLEM = netns_problem()
pytestmark = [pytest.mark.multihost, pytest.mark.skipif(PROBLEM is not None, reason=PROBLEM or "")]

TRAIN = ["-m", "pipetrain", "train", *JOB]
ATOL = 5e-5
JOB_TIMEOUT_S = 240.0


def _close(got: dict[int, float], want: dict[int, float]) -> None:
    assert got, "no step finished"
    worst = max(abs(got[step] - want[step]) for step in got)
    assert worst <= ATOL, f"largest loss difference {worst:.2e} > {ATOL:g}: {got} vs {want}"


def _one_process(*args: str) -> int:
    """`pipetrain train JOB --dp 1 --pp 1 ARGS` on this host, from this process, with environ()'s variables (one
    thread, no launcher's); its exit code."""
    with pytest.MonkeyPatch.context() as patch:
        for name in set(os.environ) - set(environ()):
            patch.delenv(name)
        for name, value in environ(PIPETRAIN_DEVICE="cpu").items():
            patch.setenv(name, value)
        return main([*TRAIN[2:], "--dp", "1", "--pp", "1", *args])


def _assert_no_process_left(cluster: Cluster) -> None:
    left = {cluster.host(i): cluster.pids(i) for i in (0, 1)}
    assert not any(left.values()), f"processes left behind: {left}"


def _start_ranks(cluster: Cluster, nodes: list[int], args: list[str]) -> list[subprocess.Popen]:
    """One `pipetrain train` per rank, rank r on host nodes[r], with the launcher's variables set by hand (rank 0's
    host holds the store: MASTER_ADDR is host 0)."""
    per_node = {node: nodes.count(node) for node in set(nodes)}
    common = {"WORLD_SIZE": str(len(nodes)), "GROUP_WORLD_SIZE": str(len(per_node)), "MASTER_ADDR": ADDRESSES[0],
              "MASTER_PORT": str(MASTER_PORT)}
    processes = []
    for rank, node in enumerate(nodes):
        env = environ(**common, RANK=str(rank), LOCAL_RANK=str(nodes[:rank].count(node)), GROUP_RANK=str(node),
                      LOCAL_WORLD_SIZE=str(per_node[node]))
        processes.append(cluster.start(node, [sys.executable, *TRAIN, *args], env, f"rank{rank}.log"))
    return processes


def test_pp_across_hosts_on_a_throttled_link_equals_one_process(cluster: Cluster, reference, tmp_path):
    """Stage 0 of both replicas on host 0, stage 1 on host 1 (ranks 0, 2 | 1, 3): every micro-batch crosses a link
    throttled to 10 Mbit/s; the step watchdog (--step-timeout 30) raises no false alarm."""
    cluster.shape("10mbit")
    run_dir = tmp_path / "run"
    processes = _start_ranks(cluster, [0, 1, 0, 1], ["--dp", "2", "--pp", "2", "--step-timeout", "30",
                                                     "--run-dir", str(run_dir)])
    codes = wait_all(processes, JOB_TIMEOUT_S)
    outputs = "\n".join(f"--- rank {r}\n{cluster.output(f'rank{r}.log')[-3000:]}" for r in range(4))
    assert codes == [0, 0, 0, 0], outputs
    assert "stopped responding" not in outputs and "pipetrain: error" not in outputs, outputs
    _close(losses(run_dir), reference)
    assert len(losses(run_dir)) == STEPS
    _assert_no_process_left(cluster)


def test_a_killed_host_is_named_and_resume_continues_with_the_same_losses(cluster: Cluster, reference, tmp_path):
    """torchrun (c10d rendezvous on host 0) with the pipeline inside each host and dp across; every process of host 1
    killed at once mid-run: within 10 s host 0 says one message naming ranks 2 and 3, and ends; the last complete
    checkpoint, resumed (in one process: checkpoints are layout-free), gives the uninterrupted run's losses."""
    run_dir, saves = tmp_path / "run", tmp_path / "saves"
    args = [*TRAIN, "--dp", "2", "--pp", "2", "--run-dir", str(run_dir), "--save-dir", str(saves),
            "--save-every", "4", "--step-timeout", "60"]
    nodes = [cluster.start(node, torchrun(node, 2, *args), environ(), f"node{node}.log") for node in (0, 1)]
    assert wait_for(lambda: len(losses(run_dir)) >= 10 or any(n.poll() is not None for n in nodes), JOB_TIMEOUT_S)
    assert all(n.poll() is None for n in nodes), cluster.output("node0.log")[-3000:]
    cluster.kill(1)
    killed_at = time.monotonic()
    said = wait_for(lambda: "pipetrain: error:" in cluster.output("node0.log"), 10.0)
    said_s = time.monotonic() - killed_at
    [code0] = wait_all(nodes[:1], 30.0)  # then torchrun ends its other rank and itself
    ended_s = time.monotonic() - killed_at
    print(f"host 1 killed: host 0 said it after {said_s:.1f} s, its torchrun ended after {ended_s:.1f} s")
    output = cluster.output("node0.log")
    seen = (f"host 0 said it after {said_s:.1f} s, ended after {ended_s:.1f} s (code {code0})\n--- host 0\n"
            f"{output[-4000:]}\n--- host 1\n{cluster.output('node1.log')[-2000:]}")
    assert said, f"host 0 said nothing within 10 s of host 1's death: {seen}"
    assert code0 not in (None, 0), f"host 0 still running after host 1 was killed: {seen}"
    assert output.count("pipetrain: error:") == 1, seen
    assert "pipetrain: error: lost ranks 2, 3 of 4" in output, seen
    wait_all(nodes, 10.0)
    _assert_no_process_left(cluster)
    before = losses(run_dir)
    _close(before, reference)

    _resume_gives(reference, saves, tmp_path / "resumed", every=4, before=before)


def _resume_gives(reference: dict[int, float], saves: Path, run_dir: Path, *, every: int,
                  before: dict[int, float]) -> None:
    """--resume from the last complete checkpoint in `saves`, in one process (checkpoints are layout-free): the
    steps from there to the end have the uninterrupted run's losses."""
    assert _one_process("--save-dir", str(saves), "--resume", "--run-dir", str(run_dir)) == 0
    after = losses(run_dir)
    assert min(after) % every == 1 and max(after) == STEPS and min(after) <= max(before) + 1, (sorted(after), before)
    _close(after, reference)


def test_a_link_down_mid_step_is_named_by_the_step_watchdog(cluster: Cluster, reference, tmp_path):
    """pp=2 across the hosts (one rank each, variables set by hand: a torchrun agent cut off from the rendezvous store
    blocks in its own store call, see docs/multi-node.md); the link taken down mid-run: within --step-timeout (8 s,
    plus slack) rank 0 names rank 1 as silent and rank 1 says the store's host does not answer; both end non-zero;
    --resume from the last complete checkpoint (in one process) gives the uninterrupted run's losses."""
    run_dir, saves = tmp_path / "run", tmp_path / "saves"
    ranks = _start_ranks(cluster, [0, 1], ["--dp", "1", "--pp", "2", "--run-dir", str(run_dir), "--save-dir",
                                           str(saves), "--save-every", "2", "--step-timeout", "8"])
    assert wait_for(lambda: len(losses(run_dir)) >= 3 or any(r.poll() is not None for r in ranks), JOB_TIMEOUT_S)
    assert all(r.poll() is None for r in ranks), cluster.output("rank0.log")[-3000:]
    cluster.link("down")
    down_at = time.monotonic()
    codes = wait_all(ranks, 8 + 40.0)
    ended_s = time.monotonic() - down_at
    out0, out1 = cluster.output("rank0.log"), cluster.output("rank1.log")
    print(f"link down: both hosts ended after {ended_s:.1f} s")
    assert None not in codes and 0 not in codes, (codes, ended_s, out0[-3000:], out1[-3000:])
    assert out0.count("pipetrain: error:") == 1 and out1.count("pipetrain: error:") == 1, (out0[-3000:], out1[-3000:])
    assert "pipetrain: error: rank 1 (last finished step" in out0 and "stopped responding" in out0, out0[-4000:]
    assert "waited 8 s (--step-timeout)" in out0, out0[-4000:]
    assert "rank 0 (which holds the job's store) does not answer" in out1, out1[-4000:]
    _assert_no_process_left(cluster)
    before = losses(run_dir)
    _close(before, reference)
    _resume_gives(reference, saves, tmp_path / "resumed", every=2, before=before)


def test_hosts_started_wrong_are_told_once(cluster: Cluster):
    """Three mistakes at once on one pair of hosts (each job alone took 15 s and 35 s, mostly start-up):

    - different layouts: host 0 started with --dp 2 --pp 1, host 1 with --dp 1 --pp 2: both fit 2 ranks, so no rank
      can tell alone; rank 0 names both layouts once, before any stage is built, and both ranks end non-zero;
    - an unreachable rendezvous: rank 1 of another two-host job started alone on host 1, its rank 0's address
      (host 0, a port nothing listens on) accepts nothing: within PIPETRAIN_JOIN_TIMEOUT (5 s here, 120 s by
      default) one message says so, no traceback;
    - a world size the nodes' rank counts do not make up for the layout: torchrun with 1 rank on host 0 and 2 on
      host 1 (3 in all) for --dp 2 --pp 1: rank 0 says so once, before joining, and both hosts end non-zero (host
      1's torchrun agent reports, in its own words, the rendezvous store gone with host 0's agent)."""
    common = {"WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_WORLD_SIZE": "2",
              "MASTER_ADDR": ADDRESSES[0], "MASTER_PORT": str(MASTER_PORT)}
    ranks = [cluster.start(rank, [sys.executable, *TRAIN, *layout], environ(**common, RANK=str(rank),
                                                                             GROUP_RANK=str(rank)), f"rank{rank}.log")
             for rank, layout in enumerate((["--dp", "2", "--pp", "1"], ["--dp", "1", "--pp", "2"]))]
    alone_port = MASTER_PORT + 10
    alone = cluster.start(1, [sys.executable, *TRAIN, "--dp", "1", "--pp", "2"],
                          environ(**common | {"RANK": "1", "GROUP_RANK": "1", "MASTER_PORT": str(alone_port),
                                              "PIPETRAIN_JOIN_TIMEOUT": "5"}), "alone.log")
    uneven = [cluster.start(node, torchrun(node, 1 + node, *TRAIN, "--dp", "2", "--pp", "1", job_id="uneven"),
                            environ(), f"uneven{node}.log") for node in (0, 1)]
    codes = wait_all(ranks, JOB_TIMEOUT_S)
    [code] = wait_all([alone], 120.0)
    uneven_codes = wait_all(uneven, 120.0)
    out0, out1, output = cluster.output("rank0.log"), cluster.output("rank1.log"), cluster.output("alone.log")
    assert None not in codes and 0 not in codes, (codes, out0[-3000:], out1[-3000:])
    assert out0.count("pipetrain: error:") == 1 and "pipetrain: error" not in out1, (out0[-3000:], out1[-3000:])
    assert ("pipetrain: error: the ranks of this job were started with different layouts: rank 0: dp=2 (ddp) x pp=1, "
            "schedule gpipe, chunks 2, partition uniform; rank 1: dp=1 (ddp) x pp=2, schedule gpipe, chunks 2, "
            "partition uniform (hint: start every node with the same") in out0, out0[-3000:]
    assert "Traceback" not in out0 + out1, (out0[-3000:], out1[-3000:])

    assert code not in (None, 0), output
    assert output.count("pipetrain: error:") == 1 and "Traceback" not in output, output
    assert (f"pipetrain: error: cannot reach rank 0's host at {ADDRESSES[0]}:{alone_port} (MASTER_ADDR:MASTER_PORT) "
            "within 5 s: Connection refused") in output, output

    host0, host1 = cluster.output("uneven0.log"), cluster.output("uneven1.log")
    assert None not in uneven_codes and 0 not in uneven_codes, (uneven_codes, host0[-3000:], host1[-3000:])
    assert host0.count("pipetrain: error:") == 1 and "pipetrain: error" not in host1, (host0[-3000:], host1[-3000:])
    assert "pipetrain: error: dp=2 x pp=1 = 2 ranks, but the job has 3" in host0, host0
    # torchrun reports the failed rank (host 0) and the rendezvous store lost with host 0's agent (host 1) with
    # tracebacks of its own; none comes from pipetrain's ranks
    frames = [line for line in (host0 + host1).splitlines() if line.lstrip().startswith('File "')]
    assert not [line for line in frames if re.search(r"/pipetrain/[a-z_/]+\.py", line)], (host0[-3000:], host1[-3000:])
    _assert_no_process_left(cluster)

"""Launching for real (gloo on loopback): a failed or killed rank ends the whole local job at once, a bad layout
under torchrun is said once, and two launcher invocations form one multi-node job (torchrun, and Slurm's
one-task-per-node pattern with Slurm's variables set by hand).

Every job runs in subprocesses, each in its own session, with a bounded wait; on a timeout or failure the
processes the test started, and their descendants, are killed by pid.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipetrain.launch.env import free_port
from pipetrain.launch.rank_reports import first_failure

JOB = ["--preset", "tiny", "--data", "synthetic", "--dp", "2", "--pp", "2", "--schedule", "gpipe", "--chunks", "2",
       "--batch-size", "16", "--train-samples", "64", "--test-samples", "32", "--epochs", "1", "--no-progress"]
EPOCH = re.compile(r"epoch 1/1  train loss \d+\.\d+ acc [\d.]+  synthetic test loss \d+\.\d+")
TORCHRUN = Path(sys.executable).with_name("torchrun")
JOB_TIMEOUT_S = 240.0
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "MASTER_ADDR", "MASTER_PORT")


def torchrun(*args: str) -> list[str]:
    launcher = [str(TORCHRUN)] if TORCHRUN.exists() else [sys.executable, "-m", "torch.distributed.run"]
    return [*launcher, *args]


def environ(**extra: str) -> dict[str, str]:
    """This process's environment without any launcher's variables, plus `extra`."""
    own = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARIABLES and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    return own | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"} | extra


def _process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, session id) of every process."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            table[int(entry.name)] = (int(fields[1]), int(fields[3]))
    return table


def _tree(root: int) -> list[int]:
    """`root` and its descendants, children of children and members of its session included (torchrun's workers
    run in sessions of their own)."""
    table = _process_table()
    found = {root} | {pid for pid, (_, sid) in table.items() if sid == root}
    frontier = list(found)
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, _) in table.items():
            if ppid == parent and pid not in found:
                found.add(pid)
                frontier.append(pid)
    return sorted(found)


def _kill_trees(processes: list[subprocess.Popen]) -> None:
    """SIGKILL every process not yet waited for, with its descendants (found before any is killed)."""
    doomed = [pid for process in processes if process.returncode is None for pid in _tree(process.pid)]
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for process in processes:
        process.wait()


def run_together(commands: list[tuple[list[str], dict[str, str]]], folder: Path, timeout_s: float) -> list[tuple[int, str]]:
    """Start every (argv, environ) at once; wait for all within `timeout_s`: (exit code, stdout + stderr) of each."""
    processes, logs = [], []
    try:
        for index, (argv, env) in enumerate(commands):
            logs.append(folder / f"process{index}.log")
            with logs[-1].open("w") as log:
                processes.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                  start_new_session=True))
        deadline = time.monotonic() + timeout_s
        while any(process.poll() is None for process in processes):
            if any(process.returncode for process in processes):
                break  # one failed: the others would wait for it in vain (the finally clause ends them)
            if time.monotonic() > deadline:
                pytest.fail(f"still running after {timeout_s:g} s:\n" + "\n".join(p.read_text()[-3000:] for p in logs))
            try:
                next(process for process in processes if process.returncode is None).wait(timeout=0.25)
            except subprocess.TimeoutExpired:
                pass
    finally:
        _kill_trees(processes)
    return [(process.returncode, log.read_text()) for process, log in zip(processes, logs)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# A rank that fails or dies: local spawn stops the others at once and reports the first failure once

FAULT_JOB = '''
"""Two spawned gloo ranks; after a barrier rank 1 fails (MODE) while rank 0 waits in a recv from it."""
import json, os, signal, sys, time


def rank_main(spec, mode, folder):
    import torch
    import torch.distributed as dist
    from pipetrain.session import join_job

    with open(os.path.join(folder, f"{mode}-rank{spec.rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    join_job(spec, timeout_s=120)
    dist.barrier()
    if spec.rank == 1:
        with open(os.path.join(folder, f"{mode}-fault"), "w") as f:
            f.write(repr(time.monotonic()))
        if mode == "raise":
            raise ValueError("boom on rank 1")
        os.kill(os.getpid(), signal.SIGKILL)
    dist.recv(torch.zeros(1), src=1)  # never sent
    time.sleep(600)


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


if __name__ == "__main__":
    from pipetrain.errors import RankFailedError
    from pipetrain.launch.env import free_port
    from pipetrain.launch.spawn import spawn

    folder = sys.argv[1]
    for mode in sys.argv[2:]:
        result = {"mode": mode, "type": None, "error": None}
        try:
            spawn(rank_main, ranks=range(2), world_size=2, master_addr="127.0.0.1", master_port=free_port(),
                  args=(mode, folder))
        except RankFailedError as err:
            ended = time.monotonic()
            with open(os.path.join(folder, f"{mode}-fault")) as f:
                fault = float(f.read())
            pids = []
            for rank in (0, 1):
                with open(os.path.join(folder, f"{mode}-rank{rank}.pid")) as f:
                    pids.append(int(f.read()))
            result.update(type=type(err).__name__, error=str(err), after_fault_s=ended - fault, pids=pids,
                          alive=[pid for pid in pids if alive(pid)])
        print(json.dumps(result), flush=True)
'''


@pytest.fixture(scope="module")
def fault_results(tmp_path_factory) -> dict[str, dict]:
    folder = tmp_path_factory.mktemp("fault")
    script = folder / "fault_job.py"
    script.write_text(FAULT_JOB)
    [(code, output)] = run_together([([sys.executable, str(script), str(folder), "raise", "kill"], environ())],
                                    folder, timeout_s=150)
    assert code == 0, output
    results = {r["mode"]: r for r in map(json.loads, (line for line in output.splitlines() if line.startswith("{")))}
    assert set(results) == {"raise", "kill"}, output
    return results


def _assert_job_ended(result: dict) -> None:
    assert result["type"] == "RankFailedError", result
    # spawn acts on the report (or the death) at once, then SIGTERM (SIGKILL after a 5 s grace) for the others;
    # before the fix it waited for the failed rank's process to end (~7 s of process-group teardown here)
    assert result["after_fault_s"] < 10, result
    assert result["alive"] == [], result  # stopped and reaped before spawn() raised
    assert not any(map(_alive, result["pids"]))


def test_a_failed_rank_stops_the_job_with_its_error_once(fault_results):
    result = fault_results["raise"]
    _assert_job_ended(result)
    error = result["error"]
    assert error.startswith("rank 1 failed:\nTraceback"), error
    assert error.count("ValueError: boom on rank 1") == 1 and error.count("Traceback") == 1, error
    assert "rank 0" not in error  # rank 0's own end (a peer that vanished) is a consequence, not reported


def test_a_killed_rank_is_reported_as_exited_without_a_report(fault_results):
    result = fault_results["kill"]
    _assert_job_ended(result)
    error = result["error"]
    # before the fix: "rank 0 failed: ... Connection reset by peer", the consequence instead of the cause
    assert error.startswith("pipetrain-rank1 exited with code -9 (SIGKILL) without a report (hint: "), error
    assert "rank 0" not in error and "Traceback" not in error, error


def test_the_first_failure_is_the_silent_death_else_the_earliest_report():
    """The attribution rule of spawn() as plain data (the race above, both ways round, without processes)."""
    killed = SimpleNamespace(name="pipetrain-rank1", exitcode=-signal.SIGKILL)
    raised = SimpleNamespace(name="pipetrain-rank1", exitcode=1)
    consequence = (2.0, 0, "Traceback ...\nRuntimeError: Connection reset by peer", True)
    cause = (1.0, 1, "Traceback ...\nValueError: boom", True)
    # rank 0 saw the connection drop and reported before rank 1's death was seen
    assert str(first_failure([consequence], [(1, killed)])).startswith("pipetrain-rank1 exited with code -9 (SIGKILL)")
    # rank 1 reported, then died during the settle time: its report is the cause, it is not "silent"
    assert str(first_failure([consequence, cause], [(1, raised)])) == "rank 1 failed:\nTraceback ...\nValueError: boom"
    user_error = (3.0, 1, "unknown schedule 'x' (hint: choose one of: gpipe)", False)
    assert str(first_failure([user_error], [])) == "unknown schedule 'x' (hint: choose one of: gpipe)"


# torchrun: a layout that does not fit the launched ranks is said once, by rank 0

def test_torchrun_world_mismatch_is_said_once(tmp_path):
    argv = torchrun("--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                    "-m", "pipetrain", "train", *JOB[:4], "--dp", "1", "--pp", "1", "--schedule", "gpipe",
                    "--chunks", "1", "--no-progress")
    [(code, output)] = run_together([(argv, environ())], tmp_path, timeout_s=120)
    assert code != 0, output
    assert output.count("pipetrain: error:") == 1, output
    assert "dp=1 x pp=1 = 1 ranks, but the job has 2 (hint: launch 1 ranks" in output, output
    # torchrun prints a traceback of its own (ChildFailedError); none comes from pipetrain's ranks
    frames = [line for line in output.splitlines() if line.lstrip().startswith('File "')]
    assert not [line for line in frames if "pipetrain" in line], output


# Two launcher invocations, one job of dp=2 x pp=2 over two "nodes" of two ranks each

def _assert_one_job(results: list[tuple[int, str]]) -> None:
    (code0, node0), (code1, node1) = results
    assert code0 == 0 and code1 == 0, f"node 0:\n{node0}\nnode 1:\n{node1}"
    assert "dp=2 (ddp) x pp=2" in node0, node0
    assert len(EPOCH.findall(node0)) == 1, node0
    assert "epoch" not in node1 and "pipetrain:" not in node1, node1  # rank 0 (on node 0) alone reports


def test_two_torchrun_nodes_form_one_job(tmp_path):
    port = str(free_port())
    commands = [
        (torchrun("--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2", "--rdzv-backend", "static",
                  "--master-addr", "127.0.0.1", "--master-port", port, "-m", "pipetrain", "train", *JOB), environ())
        for node in (0, 1)
    ]
    _assert_one_job(run_together(commands, tmp_path, JOB_TIMEOUT_S))


def test_one_task_per_node_with_slurm_variables_forms_one_job(tmp_path):
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_NNODES": "2", "SLURM_NTASKS": "2",
             "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "127.0.0.1",
             "MASTER_PORT": str(free_port())}
    commands = [
        ([sys.executable, "-m", "pipetrain", "train", "--ranks-per-node", "2", *JOB],
         environ(**slurm, SLURM_PROCID=str(node), SLURM_NODEID=str(node)))
        for node in (0, 1)
    ]
    _assert_one_job(run_together(commands, tmp_path, JOB_TIMEOUT_S))

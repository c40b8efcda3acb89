"""A two-host cluster for a test or a benchmark: two network namespaces joined by a veth pair (scripts/netns-cluster.sh), the
processes started on each host, and their removal. Traffic goes only to the namespaces' own 10.213.7.0/24."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

SCRIPT = Path(__file__).resolve().with_name("netns-cluster.sh")
ADDRESSES = ("10.213.7.1", "10.213.7.2")
RDZV_PORT = 29400
MASTER_PORT = 29500
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def netns_problem() -> str | None:
    """Why two network namespaces cannot be made here (one line), or None when they can."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces (ip netns)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (`ip`, `tc`) for network namespaces"
    probe = f"ptprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=15, check=False)
    if made.returncode:
        return f"cannot create a network namespace: {made.stderr.strip() or 'ip netns add failed'}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=15, check=False)
    return None


def environ(**extra: str) -> dict[str, str]:
    """This process's environment without any launcher's or interface variables, one thread per rank, plus `extra`."""
    own = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARIABLES and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    return own | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"} | extra


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss of the step records of a run folder's steps.jsonl (empty when it has none yet)."""
    path = run_dir / "steps.jsonl"
    if not path.exists():
        return {}
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "step"}


@dataclass
class Cluster:
    """Hosts NAME-h0 (10.213.7.1) and NAME-h1 (10.213.7.2); `start` runs a command on one of them."""

    name: str
    folder: Path
    processes: list[subprocess.Popen] = field(default_factory=list)

    def host(self, index: int) -> str:
        return f"{self.name}-h{index}"

    def device(self, index: int) -> str:
        return f"{self.name}-e{index}"

    def script(self, *args: str) -> str:
        done = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=30, check=False)
        if done.returncode:
            raise RuntimeError(f"netns-cluster.sh {' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout.strip()

    def up(self, rate: str = "off") -> None:
        self.script("up", self.name, rate)

    def down(self) -> list[int]:
        """Kill every process left on either host, remove the hosts; returns the pids that were still there."""
        left = [pid for index in (0, 1) for pid in self.pids(index)]
        for process in self.processes:  # ip netns exec itself, and anything of ours outside the namespaces
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.script("down", self.name)
        for process in self.processes:
            process.wait(timeout=30)
        return left

    def shape(self, rate: str) -> None:
        self.script("shape", self.name, rate)

    def link(self, state: str) -> None:
        self.script("link", self.name, state)

    def kill(self, index: int) -> None:
        self.script("kill", self.name, str(index))

    def pids(self, index: int) -> list[int]:
        listed = subprocess.run(["ip", "netns", "pids", self.host(index)], capture_output=True, text=True,
                                timeout=15, check=False)
        return [int(pid) for pid in listed.stdout.split()]

    def start(self, index: int, argv: list[str], env: dict[str, str], log: str) -> subprocess.Popen:
        """Run `argv` on host `index` in a session of its own, output to folder/log."""
        with (self.folder / log).open("w") as out:
            process = subprocess.Popen(["ip", "netns", "exec", self.host(index), *argv], env=env, stdout=out,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        self.processes.append(process)
        return process

    def output(self, log: str) -> str:
        return (self.folder / log).read_text()


def torchrun(node: int, nproc: int, *args: str, job_id: str = "job") -> list[str]:
    """torchrun on host `node` of the two, with the c10d rendezvous hosted on host 0 (no static master); an agent
    cut off from the rendezvous store gives up after 10 s (read_timeout, default 60 s)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{ADDRESSES[0]}:{RDZV_PORT}", "--rdzv-id", job_id,
            "--rdzv-conf", f"is_host={int(node == 0)},read_timeout=10", "--local-addr", ADDRESSES[node], "--max-restarts", "0",
            *args]


def wait_all(processes: list[subprocess.Popen], timeout_s: float) -> list[int | None]:
    """Wait up to `timeout_s` for every process; their exit codes (None: still running)."""
    deadline = time.monotonic() + timeout_s
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    return [process.poll() for process in processes]


def wait_for(predicate, timeout_s: float, poll_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll_s)
    return False

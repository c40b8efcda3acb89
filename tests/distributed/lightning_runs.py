"""Running a script whose ranks Lightning's launcher starts: its rendezvous port, and a bounded wait.

A rendezvous port for a job whose launcher picks the port long before rank 0 binds it (Lightning's launcher:
tens of seconds on a loaded machine). A port from the kernel's ephemeral range can be handed meanwhile to any
outgoing connection on the machine (gloo's, another test's), and rank 0 then fails with EADDRINUSE; a port below
that range is only taken by an explicit bind, and below 20000 none of the suite's other jobs binds one (torchrun's
29500, Slurm jobs' 20000-39999)."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
from pathlib import Path

__all__ = ["quiet_port", "run_script"]


def quiet_port() -> int:
    """A TCP port in [10000, 20000), below the ephemeral range, that was free on 127.0.0.1 a moment ago."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(200):
        port = random.randrange(10000, min(20000, low))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def run_script(argv: list[str], env: dict[str, str], log: Path, timeout_s: float) -> tuple[int | None, str]:
    """Run `argv` (which starts its other ranks itself) in a session of its own, output to `log`; after `timeout_s`
    kill the whole session (the ranks it started included: a rank left waiting for a failed rank 0 would otherwise
    hold the output open). Returns (exit code, None when killed; the output)."""
    with log.open("w") as out:
        process = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code: int | None = process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        code = None
    try:
        os.killpg(process.pid, signal.SIGKILL)  # whatever is left of the session
    except ProcessLookupError:
        pass
    process.wait()
    return code, log.read_text()

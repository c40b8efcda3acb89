"""Before joining a multi-node job: can this host reach rank 0's? A bounded wait with one clear message, instead
of a process group that waits for its whole timeout (10 minutes) on an address nobody answers."""

from __future__ import annotations

import socket
import time

from pipetrain.errors import LaunchError

__all__ = ["wait_reachable"]


def wait_reachable(host: str, port: int, *, timeout_s: float, poll_s: float = 1.0) -> float:
    """Return the seconds it took until a TCP connection to `host`:`port` (rank 0's store) is accepted; raise
    `LaunchError` when none is within `timeout_s` (rank 0 may start later than this rank: refusals are retried)."""
    start = time.monotonic()
    deadline = start + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(5.0, remaining))):
                return time.monotonic() - start
        except OSError as err:
            problem = err.strerror or str(err) or type(err).__name__
        if time.monotonic() + poll_s > deadline:
            raise LaunchError(
                f"cannot reach rank 0's host at {host}:{port} (MASTER_ADDR:MASTER_PORT) within {timeout_s:g} s: "
                f"{problem}",
                hint="start rank 0's node, and check that MASTER_ADDR (torchrun: --rdzv-endpoint) is an address the "
                     "other hosts reach, the port, and the firewall; PIPETRAIN_JOIN_TIMEOUT sets this wait (seconds)",
            ) from None
        time.sleep(poll_s)

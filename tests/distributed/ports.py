"""A rendezvous port for a job whose launcher picks the port long before rank 0 binds it (Lightning's launcher:
tens of seconds on a loaded machine). A port from the kernel's ephemeral range can be handed meanwhile to any
outgoing connection on the machine (gloo's, another test's), and rank 0 then fails with EADDRINUSE; a port below
that range is only ever taken by an explicit bind."""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["quiet_port"]


def quiet_port() -> int:
    """A TCP port below the ephemeral range that was free on 127.0.0.1 a moment ago."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(200):
        port = random.randrange(20000, max(20001, low))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")

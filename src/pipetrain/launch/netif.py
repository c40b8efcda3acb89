"""Which network interface a rank's collectives should bind to: the one that reaches rank 0's host.

gloo (and NCCL's bootstrap) pick their address from the machine's host name by default; where the host name
resolves to a loopback address (Debian's 127.0.1.1, a container's 127.0.0.1) or to an interface the other hosts
cannot reach, a multi-node job fails to connect or hangs. The interface that routes to the rendezvous address
is the one the other hosts can reach. Reads no environment variable (launch/env.py decides what to set).
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from pathlib import Path

__all__ = ["interface_of_address", "interface_towards", "default_route_interface", "is_loopback"]

_SIOCGIFADDR = 0x8915
_ROUTES = Path("/proc/net/route")


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address) resolves to a loopback address; False when it does not resolve."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def interface_of_address(address: str) -> str | None:
    """The name of the interface that holds the IPv4 `address`, or None."""
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == address:
            return name
    return None


def interface_towards(host: str) -> str | None:
    """The interface this machine uses to reach `host` (a name or an IPv4 address), or None when there is no route.

    A UDP socket is connected (nothing is sent) and its local address mapped to the interface holding it; for an
    address of this machine itself that is the interface holding that address, not `lo`.
    """
    try:
        address = socket.gethostbyname(host)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))  # the discard port; connect() on UDP only picks the route
            local = probe.getsockname()[0]
    except OSError:
        return None
    return interface_of_address(local)


def default_route_interface(routes: str | None = None) -> str | None:
    """The interface of the IPv4 default route (from /proc/net/route, or the table text `routes`), or None."""
    try:
        text = _ROUTES.read_text() if routes is None else routes
    except OSError:
        return None
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[1] == "00000000" and fields[7] == "00000000":
            return fields[0]
    return None


def _ipv4_of(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            answer = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:  # no IPv4 address on this interface
            return None
    return socket.inet_ntoa(answer[20:24])

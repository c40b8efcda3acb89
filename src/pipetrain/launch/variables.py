"""Reading one launcher variable from a mapping (the environment `launch/env.py` hands over): integers, ports,
and ranks below their counts, each refused with one message naming the variable and the fix."""

from __future__ import annotations

from collections.abc import Mapping

from pipetrain.errors import LaunchError

__all__ = ["agreed_port", "below", "integer", "port"]

_PORT_BASE = 20000
_PORT_SPAN = 20000


def integer(env: Mapping[str, str], name: str, default: int | None = None, *, minimum: int = 0) -> int:
    """The whole number in `name`, at least `minimum`; `default` when unset (None: it must be set)."""
    raw = env.get(name)
    if raw is None:
        if default is None:
            raise LaunchError(f"{name} is not set", hint=f"the launcher should export {name}; check the job script")
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise LaunchError(f"{name}={raw!r} is not an integer", hint=f"unset {name} or give it a whole number") from None
    if value < minimum:
        raise LaunchError(f"{name}={value} is below {minimum}", hint=f"unset {name} or give it a value >= {minimum}")
    return value


def below(small: str, small_value: int, big: str, big_value: int) -> None:
    """Refuse a rank `small` that is not below its count `big`."""
    if small_value >= big_value:
        raise LaunchError(
            f"{small}={small_value} is not below {big}={big_value}",
            hint=f"{small} counts from 0 to {big}-1; unset stale variables or fix the launcher",
        )


def port(env: Mapping[str, str], name: str, default: int) -> int:
    """The TCP port in `name` (`default` when unset)."""
    value = integer(env, name, default, minimum=1)
    if value > 65535:
        raise LaunchError(f"{name}={value} is not a TCP port", hint=f"pick {name} between 1024 and 65535")
    return value


def agreed_port(job_id: int) -> int:
    """The rendezvous port every process of job `job_id` agrees on without talking: in [20000, 40000)."""
    return _PORT_BASE + job_id % _PORT_SPAN

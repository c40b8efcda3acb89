"""Local launcher: starts ranks as child processes and ends them all as soon as one fails."""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait

from pipetrain.errors import PipetrainError, RankFailedError, RankTimeoutError
from pipetrain.launch.env import free_port

__all__ = ["RankSpec", "spawn", "launch_local"]


@dataclass(frozen=True)
class RankSpec:
    """Where a spawned rank sits in the job."""

    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int


def _child(fn: Callable[..., None], spec: RankSpec, args: tuple, errors: mp.Queue) -> None:
    try:
        fn(spec, *args)
    except PipetrainError as err:  # a user error: its message says it all
        errors.put((time.monotonic(), spec.rank, str(err), False))
        raise SystemExit(2) from None
    except BaseException as err:  # anything else: keep the traceback of this rank only
        detail = "".join(traceback.format_exception(err))
        errors.put((time.monotonic(), spec.rank, detail, True))
        raise SystemExit(1) from None


def _stop(processes: Sequence[mp.process.BaseProcess], grace_s: float = 5.0) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()


def spawn(
    fn: Callable[..., None],
    *,
    ranks: Sequence[int],
    world_size: int,
    master_addr: str,
    master_port: int,
    args: tuple = (),
    first_local_rank: int = 0,
    timeout_s: float | None = None,
) -> None:
    """Run `fn(RankSpec, *args)` in one fresh process per rank in `ranks`; return when all succeed.

    When a rank fails, every other rank is stopped at once and `RankFailedError` carries the first
    failure (its message, or its traceback for an unexpected error), reported once. After `timeout_s`
    seconds all ranks are stopped and `RankTimeoutError` is raised.
    """
    ctx = mp.get_context("spawn")
    errors: mp.Queue = ctx.Queue()
    processes = []
    for local, rank in enumerate(ranks):
        spec = RankSpec(rank, first_local_rank + local, world_size, master_addr, master_port)
        process = ctx.Process(target=_child, args=(fn, spec, args, errors), name=f"pipetrain-rank{rank}")
        process.start()
        processes.append(process)
    try:
        pending = {process.sentinel: process for process in processes}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            remaining = None if deadline is None else deadline - time.monotonic()
            ready = wait(list(pending), timeout=remaining)
            if not ready and deadline is not None and time.monotonic() >= deadline:
                raise RankTimeoutError(f"ranks still running after {timeout_s:g} s", hint="raise the timeout")
            for sentinel in ready:
                process = pending.pop(sentinel)
                process.join()
                if process.exitcode != 0:
                    raise _failure(process, errors)
    except BaseException:
        _stop(processes)
        raise
    finally:
        errors.close()


def _failure(process: mp.process.BaseProcess, errors: mp.Queue) -> RankFailedError:
    reports = []
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        try:
            reports.append(errors.get(timeout=0.1))
        except Exception:  # queue.Empty: keep waiting briefly for the report of the failed rank
            if reports:
                break
    if not reports:
        return RankFailedError(
            f"{process.name} exited with code {process.exitcode} without a report",
            hint="it was probably killed (out of memory?); see the system log",
        )
    _, rank, detail, unexpected = min(reports)
    if unexpected:
        return RankFailedError(f"rank {rank} failed:\n{detail.rstrip()}")
    return RankFailedError(detail)


def launch_local(fn: Callable[..., None], world_size: int, *args: object, timeout_s: float | None = None) -> None:
    """Run `fn(RankSpec, *args)` on `world_size` local ranks (127.0.0.1, a free port); raise if one fails."""
    spawn(fn, ranks=range(world_size), world_size=world_size, master_addr="127.0.0.1", master_port=free_port(),
          args=args, timeout_s=timeout_s)

"""What the local launcher makes of its ranks' pipes and deaths: the start marker, the reports already sent, the
ranks that died within a moment of each other, and the one error naming the first failure (a silent death, a rank
that died while starting, a fork server that died under its ranks)."""

from __future__ import annotations

import multiprocessing as mp
import signal
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait

from pipetrain.errors import RankFailedError
from pipetrain.launch.failures import signal_hint
from pipetrain.launch.lifeline import process_runs

__all__ = ["Report", "STARTED", "server_died", "drain_started", "died_starting", "read_reports", "deaths_within",
           "first_failure"]

#: One rank's failure report: (time.monotonic() when raised, rank, message or traceback, unexpected error?).
Report = tuple[float, int, str, bool]
#: What a rank sends first, once it runs (a rank that dies before sending it died while starting).
STARTED = "started"


def server_died(pid: int | None, processes: Sequence[mp.process.BaseProcess]) -> RankFailedError:
    """The error when the fork server that started the ranks died while they ran (they are then stopped)."""
    alive = [process.name for process in processes if process_runs(process.pid)]
    return RankFailedError(f"the fork server{'' if pid is None else f' (pid {pid})'} that started the ranks died while "
                           f"they ran, without a report; {', '.join(alive) or 'no rank'} still ran and "
                           f"{'were' if len(alive) > 1 else 'was'} stopped",
                           hint=signal_hint("SIGKILL") + "; the fork server holds torch preloaded, a likely pick of "
                                "the out-of-memory killer (PIPETRAIN_START_METHOD=spawn starts ranks without it)")


def drain_started(reader: Connection) -> bool:
    """Whether the start marker is still unread in `reader` (read it, and put nothing else back)."""
    try:
        return reader.poll() and reader.recv() == STARTED
    except (EOFError, OSError):
        return False


def died_starting(rank: int, process: mp.process.BaseProcess, fn: Callable[..., None]) -> RankFailedError:
    """The error of a rank that ended before running `fn`: most often a script without a main guard."""
    name = getattr(fn, "__qualname__", repr(fn))
    return RankFailedError(
        f"{process.name} died while starting, before running {name}() (exit code {process.exitcode})",
        hint="every rank imports your script again (as with multiprocessing's 'spawn'): a "
             "script that calls launch_local() (or spawn) at module level must do it under "
             "`if __name__ == \"__main__\":`",
    )


def read_reports(readers: Sequence[Connection]) -> list[Report]:
    """The reports already sent by any rank (a report is in its pipe before the rank's process ends)."""
    reports = []
    for reader in readers:
        try:
            while reader.poll():
                message = reader.recv()
                if message != STARTED:
                    reports.append(message)
                    break
        except (EOFError, OSError):
            pass
    return reports


def deaths_within(
    running: dict[int, tuple[int, mp.process.BaseProcess]], *, settle_s: float
) -> list[tuple[int, mp.process.BaseProcess]]:
    """The ranks of `running` that end in failure within `settle_s` seconds, as (rank, process)."""
    deaths = []
    deadline = time.monotonic() + settle_s
    while running:
        ready = wait(list(running), timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        for sentinel in ready:
            rank, process = running.pop(sentinel)
            process.join()
            if process.exitcode != 0:
                deaths.append((rank, process))
    return deaths


def first_failure(reports: list[Report], deaths: list[tuple[int, mp.process.BaseProcess]]) -> RankFailedError:
    """The first failure: a rank that ended in failure without a report, else the earliest report.

    A rank that ends without a report (a signal, the out-of-memory killer) is the cause: its peers see their
    connections to it close as it dies and may report that before its death is seen, but those are consequences.
    """
    reported = {report[1] for report in reports}
    silent = [process for rank, process in deaths if rank not in reported]
    if silent:
        code = silent[0].exitcode
        name = signal.Signals(-code).name if code is not None and -code in signal.valid_signals() else None
        return RankFailedError(f"{silent[0].name} exited with code {code if name is None else f'{code} ({name})'} "
                               "without a report", hint=signal_hint(name))
    _, rank, detail, unexpected = min(reports)
    if unexpected:
        return RankFailedError(f"rank {rank} failed:\n{detail.rstrip()}")
    return RankFailedError(detail)

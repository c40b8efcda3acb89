"""Local launcher: starts ranks as child processes and ends them all as soon as one fails, or the fork server that
started them dies; each rank ends by itself when the launcher is gone (launch/lifeline.py)."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from multiprocessing.connection import Connection, wait
from typing import NoReturn

from pipetrain.errors import PipetrainError, RankTimeoutError
from pipetrain.launch.device import check_local_ranks, resolve_device
from pipetrain.launch.env import free_port
from pipetrain.launch.forkserver import Inherited, context, server_pid
from pipetrain.launch.lifeline import Lifeline, process_runs, signal_pids
from pipetrain.launch.rank_reports import (
    STARTED, deaths_within, died_starting, drain_started, first_failure, read_reports, server_died,
)
from pipetrain.launch.ranks import RankSpec, launch_start_s

__all__ = ["RankSpec", "spawn", "launch_local", "fail_now", "FORWARDED_SIGNALS", "spawned_rank"]


#: Seconds to wait, after a rank's report, for a rank that died without one at the same moment
#: (see rank_reports.first_failure).
_SETTLE_S = 0.5
#: Signals the launcher passes on to its ranks (a stop request from Slurm or `kill`; see checkpoint.stop).
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
#: This rank's report pipe, when the rank was started by `spawn` (set once per rank process, see `fail_now`).
_REPORT: tuple[Connection, int] | None = None


#: Seconds a rank ending quietly under `spawn` waits for the launcher to stop it (after another's report).
_QUIET_END_S = 30.0


def fail_now(message: str, *, code: int = 1) -> NoReturn:
    """End this rank at once from any thread, reporting `message` once (an empty message stays silent).

    Under `spawn` the message goes to the launcher, which stops every rank and raises it; under torchrun or
    srun it is printed, and the launcher ends the other ranks when this one exits. A rank ending quietly under
    `spawn` leaves that to the launcher (for up to `_QUIET_END_S`): dead first and without a report, it would be
    taken for the cause.
    """
    if not message and _REPORT is not None:
        time.sleep(_QUIET_END_S)
    if message:
        if _REPORT is not None:
            try:
                _REPORT[0].send((time.monotonic(), _REPORT[1], message, False))
            except OSError:
                pass
        else:
            print(f"pipetrain: error: {message}", file=sys.stderr, flush=True)
    os._exit(code)


def spawned_rank() -> int | None:
    """This process's rank when `spawn` started it (a local rank), else None (a launcher, or a rank placed by
    torchrun, mpirun or Slurm)."""
    return None if _REPORT is None else _REPORT[1]


def _child(fn: Callable[..., None], spec: RankSpec, args: tuple, report: Connection, inherited: Inherited) -> None:
    global _REPORT
    inherited.apply(spec.rank)
    inherited.watch_launcher(spec.rank, say=spec.local_rank == 0)
    _REPORT = (report, spec.rank)
    report.send(STARTED)
    try:
        fn(spec, *args)
    except PipetrainError as err:  # a user error: its message says it all
        report.send((time.monotonic(), spec.rank, str(err), False))
        raise SystemExit(2) from None
    except BaseException as err:  # anything else: keep the traceback of this rank only
        detail = "".join(traceback.format_exception(err))
        report.send((time.monotonic(), spec.rank, detail, True))
        raise SystemExit(1) from None
    _exit_after_success()


def _exit_after_success() -> NoReturn:
    """End a rank whose function returned, without the interpreter's teardown.

    Process groups stay referenced by meshes, stages and schedules after `destroy_process_group`; when the
    interpreter frees them while it shuts down, gloo's worker threads can abort the process ("terminate called
    without an active exception", SIGABRT) after the rank's work succeeded. Collecting them while the interpreter
    is alive, then leaving with `os._exit`, ends the rank with the code it earned.
    """
    gc.collect()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


def _stop(processes: Sequence[mp.process.BaseProcess], grace_s: float = 1.0) -> None:
    """SIGTERM, then SIGKILL after `grace_s` (a rank that saves on SIGTERM only records it; a stopped one ignores it).
    Ranks whose fork server died are no children of anyone here: they are signalled by pid."""
    orphans = [process.pid for process in processes if process.exitcode is not None and process_runs(process.pid)]
    for process in processes:
        if process.is_alive():
            process.terminate()
    signal_pids(orphans, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()
    while any(process_runs(pid) for pid in orphans) and time.monotonic() < deadline:
        time.sleep(0.05)
    signal_pids([pid for pid in orphans if process_runs(pid)], signal.SIGKILL)


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
    device: str | None = None,
    nodes: int = 1,
    start_method: str | None = None,
) -> None:
    """Run `fn(RankSpec, *args)` in one new process per rank in `ranks` (on the CPU forked from the fork server, see
    launch/forkserver.py; fresh interpreters on CUDA and with PIPETRAIN_START_METHOD=spawn); return when all succeed.

    When a rank fails, every other rank is stopped at once and `RankFailedError` carries the first
    failure (its message, or its traceback for an unexpected error), reported once. A rank's report is
    acted on when it is sent, not when the rank's process has ended (tearing down a process group can
    take long). After `timeout_s` seconds all ranks are stopped and `RankTimeoutError` is raised.
    `device` ("cpu", "cuda"; default: PIPETRAIN_DEVICE, else CUDA when present) goes to every rank's spec; on CUDA,
    more ranks than GPUs raise `ConfigError` before any rank starts. `nodes`: the hosts the whole job spans.
    `start_method`: "spawn" for fresh interpreters whatever PIPETRAIN_START_METHOD says (None: as it says).
    """
    device = resolve_device(device)
    check_local_ranks(first_local_rank + len(ranks), device)
    ctx = context(device, start_method)
    launched_at = launch_start_s()
    processes: list[mp.process.BaseProcess] = []
    readers: list[Connection] = []  # one pipe per rank, for its failure report
    running: dict[int, tuple[int, mp.process.BaseProcess]] = {}  # sentinel -> (rank, process)
    started: set[Connection] = set()  # the readers of ranks that have started running
    server = server_pid() if ctx.get_start_method() == "forkserver" else None
    with _forwarding(processes), Lifeline() as lifeline:
        try:
            for local, rank in enumerate(ranks):
                spec = RankSpec(rank, first_local_rank + local, world_size, master_addr, master_port, device, nodes,
                                launched_at)
                reader, writer = ctx.Pipe(duplex=False)
                readers.append(reader)
                inherited = Inherited(lifeline=lifeline.reader)
                process = ctx.Process(target=_child, args=(fn, spec, args, writer, inherited), name=f"pipetrain-rank{rank}")
                with _sigint_held():  # a rank half-started by a Ctrl-C could not be stopped, and would print a traceback
                    process.start()
                    processes.append(process)
                writer.close()
                running[process.sentinel] = (rank, process)
            listening = set(readers)  # the readers of ranks that have not closed their end yet
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            while running:
                remaining = None if deadline is None else deadline - time.monotonic()
                ready = wait([*listening, *running], timeout=remaining)
                if not ready and deadline is not None and time.monotonic() >= deadline:
                    raise RankTimeoutError(f"ranks still running after {timeout_s:g} s", hint="raise the timeout")
                for handle in ready:
                    if handle in listening:
                        try:
                            first = handle.recv()
                        except EOFError:  # closed without a report: this rank is ending, its sentinel tells how
                            listening.discard(handle)
                            continue
                        if first == STARTED:
                            started.add(handle)
                            continue
                        deaths = deaths_within(running, settle_s=_SETTLE_S)  # first: a rank's report precedes its death
                        raise first_failure([first, *read_reports(readers)], deaths)
                    if handle in running:
                        rank, process = running.pop(handle)
                        process.join()
                        if process.exitcode != 0 and process_runs(process.pid):  # its fork server died, not the rank
                            raise server_died(server or server_pid(), processes)
                        if process.exitcode != 0:
                            reader = readers[processes.index(process)]
                            if reader not in started and not drain_started(reader):
                                raise died_starting(rank, process, fn)
                            raise first_failure(read_reports(readers), [(rank, process)])
        except BaseException:
            _stop(processes)
            raise
        finally:
            for reader in readers:
                reader.close()


@contextmanager
def _sigint_held() -> Iterator[None]:
    """Hold a SIGINT (Ctrl-C) that lands inside the block until its end, then take it as it would have been taken
    (main thread only): starting a process is not cut short halfway, leaving a child reading half its arguments."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda number, frame: held.append(number))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            os.kill(os.getpid(), signal.SIGINT)


@contextmanager
def _forwarding(processes: list[mp.process.BaseProcess]) -> Iterator[None]:
    """Pass SIGTERM and SIGUSR1 received by the launcher on to the ranks while they run (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(number: int, frame: object) -> None:
        for process in processes:
            if process.pid is not None and process.exitcode is None:
                try:
                    os.kill(process.pid, number)
                except ProcessLookupError:
                    pass

    previous = {number: signal.signal(number, forward) for number in FORWARDED_SIGNALS}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def launch_local(fn: Callable[..., None], world_size: int, *args: object, timeout_s: float | None = None,
                 device: str | None = None) -> None:
    """Run `fn(RankSpec, *args)` on `world_size` local ranks (127.0.0.1, a free port); raise if one fails.
    `device` as for `spawn` (more ranks than GPUs are refused before any starts)."""
    spawn(fn, ranks=range(world_size), world_size=world_size, master_addr="127.0.0.1", master_port=free_port(),
          args=args, timeout_s=timeout_s, device=device)

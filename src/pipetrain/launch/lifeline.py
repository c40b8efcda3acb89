"""A rank's lifeline: every rank ends within a second when the process that launched it is gone, whatever ended it
(SIGKILL included) and whichever process stood between them.

`PR_SET_PDEATHSIG` alone does not do it: a forked rank's parent is the fork server, not the launcher, and a signal
asked for the parent's death is not sent when a grandparent dies. So:

- `spawn` (launch/spawn.py) keeps the write end of one pipe per job (`Lifeline`) and hands the read end to every
  rank (pickled with the rank's arguments, as its standard streams are: launch/forkserver.py's `Inherited`). No other
  process holds the write end, so a rank reads EOF exactly when the launcher is gone; its watcher thread then says so
  (the lowest local rank only) and ends the rank. The fork server and multiprocessing's resource tracker end once no
  rank holds their pipes any more.
- A rank started by torchrun (whose agent is its parent) has no such pipe: `watch_parent` polls its parent's pid
  and ends the rank when the agent is gone.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Sequence

from pipetrain.launch.env import under_torchrun_agent
from pipetrain.launch.ranks import ClusterEnv

__all__ = ["Lifeline", "watch_fd", "watch_parent", "watch_agent", "process_runs", "signal_pids", "POLL_S"]

#: Seconds between two looks at the parent's pid (`watch_parent`).
POLL_S = 0.5


class Lifeline:
    """The launcher's side: a pipe whose write end only the launcher holds (`reader` goes to the ranks)."""

    def __init__(self) -> None:
        self.reader, self._writer = os.pipe()  # both close on exec: nothing but `spawn`'s pickling hands them on
        self.launcher = os.getpid()

    def close(self) -> None:
        for fd in (self.reader, self._writer):
            try:
                os.close(fd)
            except OSError:
                pass

    def __enter__(self) -> Lifeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _end(message: str, say: bool) -> None:
    if say:
        print(f"pipetrain: error: {message}", file=sys.stderr, flush=True)
    os._exit(1)


def watch_fd(fd: int, *, rank: int, launcher: int, say: bool, end: Callable[[str, bool], None] = _end) -> None:
    """In a rank: end it (`end(message, say)`) once `fd`, the read end of its launcher's lifeline, reads EOF."""

    def wait() -> None:
        while True:
            try:
                if os.read(fd, 1) == b"":
                    break
            except InterruptedError:
                continue
            except OSError:
                break
        end(f"the launcher of this job (pid {launcher}) is gone (killed?): rank {rank} and the others it started "
            "end too", say)

    threading.Thread(target=wait, name="pipetrain-lifeline", daemon=True).start()


def watch_parent(*, rank: int, say: bool, what: str = "torchrun's agent",
                 end: Callable[[str, bool], None] = _end) -> None:
    """In a rank started by a launcher that is its parent (torchrun's agent): end it once the parent is gone."""
    parent = os.getppid()

    def poll() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_S)
        end(f"{what} (pid {parent}), which started this rank, is gone (killed?): rank {rank} ends too", say)

    threading.Thread(target=poll, name="pipetrain-lifeline", daemon=True).start()


def watch_agent(env: ClusterEnv) -> None:
    """In a rank that torchrun's agent started (not one a user started by hand with RANK, MASTER_ADDR...): end it
    once the agent is gone (its lowest local rank says so)."""
    if env.source == "torchrun" and under_torchrun_agent():
        watch_parent(rank=env.rank, say=env.local_rank == 0)


def signal_pids(pids: Sequence[int | None], number: int) -> None:
    """Send signal `number` to each of `pids` that still exists (ranks whose fork server died: nobody's children)."""
    for pid in pids:
        if pid is not None:
            try:
                os.kill(pid, number)
            except (ProcessLookupError, PermissionError):
                pass


def process_runs(pid: int | None) -> bool:
    """Whether the process `pid` runs (not ended, nor a zombie waiting for its parent)."""
    if pid is None:
        return False
    if os.path.isdir("/proc/self"):
        try:
            with open(f"/proc/{pid}/stat", "rb") as handle:
                return handle.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
        except (OSError, IndexError):
            return False
    try:  # not Linux: ask the kernel whether the pid exists
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

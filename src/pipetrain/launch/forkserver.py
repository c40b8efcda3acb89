"""How rank processes start: forked from a server that has imported torch once, not each importing it anew.

A fresh interpreter spends seconds importing torch, its pipelining, DTensor and DCP before a rank runs a line of
pipetrain; with `spawn`, every rank of every job pays that. The fork server (multiprocessing's `forkserver`)
imports them once per launcher and forks each rank from there, on the same terms as `spawn` otherwise: a rank
re-imports the launcher's `__main__` (a script without a main guard fails the same way), runs with the
launcher's working directory, `sys.path`, environment and standard output/error as they are when the rank
starts (the server's own are those of its start), and initialises no CUDA, threads or RNG state it could share.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import sys
from multiprocessing import forkserver, reduction
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any

__all__ = ["PRELOAD", "context", "warm_up", "Inherited", "RANK_NAME_PREFIX"]

#: What the server imports before it forks: the bulk of a rank's start-up (not `__main__`: see the module doc).
PRELOAD = (
    "torch",
    "torch.distributed.pipelining",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "pipetrain.session",
    "pipetrain.trainer",
)
#: What a rank is called in `ps -o comm` and top (Linux, at most 15 characters: pipetrain-r0, pipetrain-r12, ...);
#: its command line is the fork server's.
RANK_NAME_PREFIX = "pipetrain-r"
#: Whether this process ends its server at exit (`warm_up` registers it once).
_STOP_AT_EXIT = False
#: The standard streams a rank writes to, as the launcher has them when the rank starts.
_STREAMS = (1, 2)


def context() -> BaseContext:
    """The multiprocessing context ranks are started with."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def warm_up() -> None:
    """Start the server now (it imports in the background), so that ranks started later fork at once; it ends
    with this process."""
    global _STOP_AT_EXIT
    context()
    forkserver.ensure_running()
    if not _STOP_AT_EXIT:
        _STOP_AT_EXIT = True
        atexit.register(_stop_server)


def _stop_server() -> None:
    """End the server at exit even while it is still importing (it would finish that first, on a busy CPU)."""
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if pid is not None:
        try:
            os.kill(pid, 9)
        except OSError:
            pass


class Inherited:
    """What a spawned rank would inherit from its launcher at start and a fork server's child does not: the
    environment and the standard output and error, taken when the rank is started (pickled into it)."""

    def __init__(self, environ: dict[str, str] | None = None, streams: dict[int, Any] | None = None) -> None:
        self.environ = dict(os.environ) if environ is None else environ
        self.streams = streams or {}

    def __reduce__(self) -> tuple:
        # pickled while the rank's process is being started: DupFd hands the descriptors to that process
        open_streams = {fd: reduction.DupFd(fd) for fd in _STREAMS if _is_open(fd)}
        return Inherited, (self.environ, open_streams)

    def apply(self, rank: int) -> None:
        """In rank `rank`: take the launcher's environment and standard streams as its own, and its name."""
        try:
            Path("/proc/self/comm").write_text(f"{RANK_NAME_PREFIX}{rank}"[:15])
        except OSError:  # not Linux: the name is cosmetic
            pass
        os.environ.clear()
        os.environ.update(self.environ)
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        for target, handle in self.streams.items():
            fd = handle.detach()
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True

"""How rank processes start: forked from a server that has imported torch once, not each importing it anew.

A fresh interpreter spends seconds importing torch, its pipelining, DTensor and DCP before a rank runs a line of
pipetrain; with `spawn`, every rank of every job pays that. The fork server (multiprocessing's `forkserver`)
imports them once per launcher and forks each rank from there, on the same terms as `spawn` otherwise: a rank
re-imports the launcher's `__main__` (a script without a main guard fails the same way), runs with the
launcher's working directory, `sys.path`, environment and standard output/error as they are when the rank
starts (the server's own are those of its start), and with the random state of a fresh interpreter. The server
initialises no CUDA and starts no threads, so a fork from it is safe.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from multiprocessing import forkserver, reduction
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any

from pipetrain.launch.env import device_override, start_method
from pipetrain.launch.lifeline import watch_fd

__all__ = ["PRELOAD", "context", "preload_also", "warm_up", "Inherited", "RANK_NAME_PREFIX", "server_pid"]

#: What the server imports before it forks: the bulk of a rank's start-up (not `__main__`: see the module doc).
PRELOAD = (
    "torch",
    "torch.distributed.pipelining",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "pipetrain.session",
    "pipetrain.train.loop",
    "pipetrain.launch.forkserver_setup",  # last: the server's own set-up, once the rest is imported
)
#: Modules a launcher asked the server to import too (`preload_also`), before its own set-up.
_ALSO: list[str] = []
#: What a rank is called in `ps -o comm` and top (Linux, at most 15 characters: pipetrain-r0, pipetrain-r12, ...);
#: its command line is the fork server's.
RANK_NAME_PREFIX = "pipetrain-r"
#: The standard streams a rank writes to, as the launcher has them when the rank starts.
_STREAMS = (1, 2)


def context(device: str = "cpu", method: str | None = None) -> BaseContext:
    """The multiprocessing context ranks on `device` ("cpu", "cuda") are started with: the fork server, or `spawn`
    where `method` or else PIPETRAIN_START_METHOD asks for fresh interpreters, and on CUDA: a server whose imports
    initialised the CUDA runtime (a `torch.cuda.is_available()` at import does) would hand its forks a runtime they
    cannot use, and that is not yet checked on a GPU."""
    if (method or start_method()) == "spawn" or device != "cpu":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD[:-1], *_ALSO, PRELOAD[-1]])
    return ctx


def preload_also(*modules: str) -> None:
    """Have the server import `modules` too before it forks, for a launcher whose every job's ranks import them
    (the test suite's Hugging Face jobs: transformers). A module that fails to import is skipped by the server, and
    a rank imports it itself; no effect once this process's server runs."""
    _ALSO.extend(name for name in modules if name not in _ALSO and name not in PRELOAD)


def server_pid() -> int | None:
    """The pid of this process's fork server, when one runs (None: none, or a Python that does not say)."""
    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def warm_up() -> None:
    """Start the server now (it imports in the background), so that ranks started later fork at once. It ends
    when this process does (at once if idle, else once its imports are done). Not where PIPETRAIN_DEVICE=cuda
    (CUDA ranks are not forked); on a GPU node without it the server may go unused."""
    if context(device_override() or "cpu").get_start_method() == "forkserver":
        forkserver.ensure_running()


class Inherited:
    """What a spawned rank would inherit from its launcher at start and a fork server's child does not: the
    environment and the standard output and error, taken when the rank is started (pickled into it), and the read
    end of the launcher's lifeline (`lifeline`: its descriptor; `launcher`: its pid; see launch/lifeline.py)."""

    def __init__(self, environ: dict[str, str] | None = None, streams: dict[int, Any] | None = None,
                 lifeline: Any = None, launcher: int | None = None) -> None:
        self.environ = dict(os.environ) if environ is None else environ
        self.streams = streams or {}
        self.lifeline = lifeline
        self.launcher = os.getpid() if launcher is None else launcher

    def __reduce__(self) -> tuple:
        # pickled while the rank's process is being started: DupFd hands the descriptors to that process
        open_streams = {fd: reduction.DupFd(fd) for fd in _STREAMS if _is_open(fd)}
        lifeline = None if self.lifeline is None else reduction.DupFd(self.lifeline)
        return Inherited, (self.environ, open_streams, lifeline, self.launcher)

    def apply(self, rank: int) -> None:
        """In rank `rank`: take the launcher's environment and standard streams as its own, and its name."""
        try:
            Path("/proc/self/comm").write_text(f"{RANK_NAME_PREFIX}{rank}"[:15])
        except OSError:  # not Linux: the name is cosmetic
            pass
        os.environ.clear()
        os.environ.update(self.environ)
        _fresh_random_state()
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        for target, handle in self.streams.items():
            fd = handle.detach()
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)

    def watch_launcher(self, rank: int, *, say: bool) -> None:
        """In rank `rank`: end it once its launcher is gone (launch/lifeline.py); `say`: this rank says so."""
        if self.lifeline is not None:
            fd = self.lifeline.detach() if hasattr(self.lifeline, "detach") else self.lifeline
            watch_fd(fd, rank=rank, launcher=self.launcher, say=say)


def _fresh_random_state() -> None:
    """Seed torch's and numpy's global generators from the OS's entropy, as a fresh interpreter does: forked
    ranks would otherwise all draw the server's numbers (Python's `random` is reseeded by every fork already)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True

"""Hang reports: when the step watchdog fires, every rank that still runs writes its Python stacks and where it is.

Each rank registers `faulthandler` on `DUMP_SIGNAL` (SIGUSR2: SIGUSR1 is Slurm's stop warning) into its file
`<run folder>/hang/rank-N.txt`, opened when the watchdog starts and removed again, empty, when the job ends well.
When the watchdog fires, the rank's watchdog thread (which runs while the main thread waits in a collective: the
wait releases the GIL) writes where the main thread is (`where`: in a torch.distributed wait, or computing, with
the pipeline action when the schedule names one) and every thread's stack. A rank whose watchdog thread cannot
run (a C call holding the GIL) still dumps on `kill -USR2 PID`: the handler is C code, and the reporting rank
sends it to the ranks of its host that gave no answer. A stopped (SIGSTOP) or dead rank writes nothing; the
watchdog names it from its heartbeat. With NCCL, torch's flight recorder (on when the job starts on CUDA, see
`launch.env.flight_recorder_variables`) is dumped beside: `nccl-rank-N.pkl`, readable with
`python -m torch.distributed.flight_recorder.fr_trace`.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import IO

import torch.distributed as dist

from pipetrain.compat.modules import flight_record

__all__ = ["DUMP_SIGNAL", "HangReport", "where", "hang_message", "HANG_FOLDER"]

#: The signal that makes a rank write every thread's stack into its hang file.
DUMP_SIGNAL = signal.SIGUSR2
#: The folder of the run folder that receives the files.
HANG_FOLDER = "hang"
_TORCH_DISTRIBUTED = os.sep + os.path.join("torch", "distributed") + os.sep
_WAITING = "waits"


def _frames(frame: FrameType | None) -> list[FrameType]:
    """Innermost first."""
    found = []
    while frame is not None:
        found.append(frame)
        frame = frame.f_back
    return found


def _at(frame: FrameType) -> str:
    return f"{frame.f_code.co_name} ({Path(frame.f_code.co_filename).name}:{frame.f_lineno})"


def where(frame: FrameType | None) -> tuple[bool, str]:
    """(waiting in torch.distributed?, a few words): what the thread whose innermost frame is `frame` does."""
    frames = _frames(frame)
    if not frames:
        return False, "has no Python frame"
    action = next((f.f_locals.get("action") for f in frames
                   if f.f_code.co_filename.endswith(os.path.join("pipelining", "schedules.py"))
                   and f.f_locals.get("action") is not None), None)
    during = f" during pipeline action {action}" if action is not None else ""
    inner = frames[0]
    if _TORCH_DISTRIBUTED in inner.f_code.co_filename:
        return True, f"{_WAITING} in torch.distributed {_at(inner)}{during}"
    return False, f"runs {_at(inner)}{during}"


def hang_message(wheres: dict[int, tuple[bool, str]]) -> str:
    """Who did not arrive and where the others wait, from each answering rank's `where` (pure)."""
    if not wheres:
        return ""
    away = sorted(r for r, (waiting, _) in wheres.items() if not waiting)
    parts = [f"rank {r} did not arrive: it {wheres[r][1]}" for r in away]
    waiting: dict[str, list[int]] = {}
    for r, (is_waiting, text) in sorted(wheres.items()):
        if is_waiting:
            waiting.setdefault(text, []).append(r)
    parts += [f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} {text}" for text, rs in waiting.items()]
    return "; ".join(parts)


def encode(answer: tuple[bool, str]) -> str:
    return ("W" if answer[0] else "R") + answer[1]


def decode(text: str) -> tuple[bool, str]:
    return text[:1] == "W", text[1:]


class HangReport:
    """This rank's hang file (`folder` None: stacks go to stderr) and its dump."""

    def __init__(self, folder: Path | None, rank: int) -> None:
        self.folder = None if folder is None else Path(folder)
        self.rank = rank
        self.host = socket.gethostname()
        self.path = None if self.folder is None else self.folder / f"rank-{rank}.txt"
        self._file: IO[str] | None = None
        self._main = threading.main_thread().ident

    def install(self) -> None:
        """Open the file and register the signal handler (main thread or not: faulthandler does not care)."""
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("w", encoding="utf-8")
        faulthandler.register(DUMP_SIGNAL, file=self._file or sys.stderr, all_threads=True)

    def dump(self) -> tuple[bool, str]:
        """Write where the main thread is and every thread's stack; return the former (see `where`)."""
        answer = where(sys._current_frames().get(self._main))
        out = self._file or sys.stderr
        out.write(f"rank {self.rank} on {self.host} (pid {os.getpid()}) {answer[1]}\n\n")
        out.flush()
        faulthandler.dump_traceback(file=out, all_threads=True)
        if dist.is_initialized() and self.folder is not None:
            record = flight_record(dist.get_backend())
            if record is not None:
                (self.folder / f"nccl-rank-{self.rank}.pkl").write_bytes(record)
        return answer

    def close(self) -> None:
        """The job ends without a hang: unregister, and remove the empty file (and folder)."""
        faulthandler.unregister(DUMP_SIGNAL)
        if self._file is not None:
            self._file.close()
            self._file = None
            assert self.path is not None
            try:
                if self.path.stat().st_size == 0:
                    self.path.unlink()
                    self.path.parent.rmdir()  # fails while another rank's file is there: fine
            except OSError:
                pass

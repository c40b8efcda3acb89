"""Stop requests (SIGTERM, Slurm's warning signal SIGUSR1) that every rank honours at the same step boundary."""

from __future__ import annotations

import signal
import threading
from types import FrameType

import torch
import torch.distributed as dist

__all__ = ["STOP_SIGNALS", "StopRequest"]

#: Signals that ask a job to save and stop: Slurm sends SIGUSR1 before the time limit (`--signal`), SIGTERM at it.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Records a stop signal received by this rank; `agreed()` tells every rank whether any rank got one.

    A signal reaches the ranks at different moments (or only some of them), so each rank asks at every step
    boundary with one all-reduce of a flag: all ranks then stop after the same step.
    """

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        """Catch the stop signals in this process (main thread only; elsewhere nothing is installed)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for number in STOP_SIGNALS:
            self._previous[number] = signal.signal(number, self._record)

    def uninstall(self) -> None:
        """Restore the signal handlers `install` replaced."""
        for number, handler in self._previous.items():
            signal.signal(number, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _record(self, number: int, frame: FrameType | None) -> None:
        self.signal_name = self.signal_name or signal.Signals(number).name

    def agreed(self, device: torch.device) -> bool:
        """True on every rank when any rank has received a stop signal (a collective call)."""
        flag = torch.tensor([1.0 if self.signal_name else 0.0], device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0 and self.signal_name is None:
            self.signal_name = "a stop signal on another rank"
        return flag.item() > 0

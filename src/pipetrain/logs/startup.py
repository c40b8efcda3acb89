"""Start-up time by phase on one rank, from the process's start to the end of its first step, logged once.

Phases: `imports+data` (the interpreter's start, the imports, the command line and the data, up to the session: the
time since the job's command began, when the session opens — the start of the process that started the job (the
launcher of ranks forked by `spawn`, else the rank's own; from Linux /proc), or the beginning of a later command in
that process, `launch.ranks.launch_start_s`), `join` (the bounded wait for rank 0's host, the store's rendezvous and the process group's
connections), `layout check` (one all-gather of every rank's flags), `mesh` (the dp/pp/tp process groups),
`stages` (building this rank's pipeline stages and the schedule), `setup` (optimizer, checkpoint, logs, data
iterator: up to the first step's start) and `first step` (its forward, backward and optimizer, with the first
point-to-point transfers between stages). Under torchrun the agents' own rendezvous happens before the ranks
start, so it is in none of these.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from pipetrain.launch.ranks import process_start_s
from pipetrain.logs.records import EvalRecord, StepRecord

__all__ = ["Startup", "StartupSink", "process_age_s", "process_start_s", "PHASES"]

log = logging.getLogger("pipetrain")
PHASES = ("imports+data", "join", "layout check", "mesh", "stages", "setup", "first step")


def process_age_s(started_at: float | None = None) -> float | None:
    """Seconds since `started_at` (boot clock; default: this process's start), None where unknown."""
    start = process_start_s() if started_at is None else started_at
    try:
        return None if start is None else time.clock_gettime(time.CLOCK_BOOTTIME) - start
    except AttributeError:  # no boot clock here
        return None


class Startup:
    """The seconds of each phase, filled as the session opens (`phase`) and by the first step (`StartupSink`)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, *, started_at: float | None = None):
        """`started_at`: when the job's start-up began (boot clock, `launch_start_s` of its launcher); default:
        this process's start."""
        self.clock = clock
        self.seconds: dict[str, float] = {}
        age = process_age_s(started_at)
        if age is not None:
            self.seconds["imports+data"] = age
        self.ready_at: float | None = None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = self.clock()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + self.clock() - start
            self.ready_at = self.clock()

    def first_step(self, step_time_s: float) -> None:
        """The first step ended now after `step_time_s`: setup is what lies between the session and its start."""
        if self.ready_at is not None:
            self.seconds["setup"] = max(self.clock() - step_time_s - self.ready_at, 0.0)
        self.seconds["first step"] = step_time_s

    def line(self) -> str:
        """e.g. ``start-up: 14.20 s to the end of the first step: imports+data 6.10 s | join 2.30 s | ...``."""
        parts = [f"{name} {self.seconds[name]:.2f} s" for name in PHASES if name in self.seconds]
        return f"start-up: {sum(self.seconds.values()):.2f} s to the end of the first step: " + " | ".join(parts)


class StartupSink:
    """Logs `Startup.line` once, after the first step record (rank 0's figures)."""

    def __init__(self, startup: Startup):
        self.startup, self.done = startup, False

    def step(self, record: StepRecord) -> None:
        if not self.done:
            self.done = True
            self.startup.first_step(record.step_time_s)
            log.info("pipetrain: %s", self.startup.line())

    def eval(self, record: EvalRecord) -> None:
        pass

    def close(self) -> None:
        pass

"""Step watchdog: a rank that sees no step finish within the timeout names the stuck ranks and ends the job.

Long work that is no step (a checkpoint's save, a resume's load, the first step, which builds the schedules and
compiles) runs under a longer limit of its own (`during`, `until_next_step`: `--save-timeout`), named in the message
when even that runs out; while it lasts, a rank whose heartbeat stops for `--step-timeout` (stopped, frozen, dead)
still ends the job after that shorter time.
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from pipetrain.launch.hangs import DUMP_SIGNAL, HangReport, decode, encode, hang_message

__all__ = ["HEARTBEAT_PREFIX", "STORE_TIMEOUT_S", "Allowance", "StepWatchdog", "beat_period", "bounded", "fired_key",
           "await_report", "REPORT_WAIT_S", "waited_text", "stuck_message"]

T = TypeVar("T")

_PREFIX = "pipetrain/watchdog/"
#: The store key of rank r's last heartbeat (its wall-clock time) is HEARTBEAT_PREFIX + str(r).
HEARTBEAT_PREFIX = _PREFIX + "beat/"
#: Seconds a store read may take; longer means the rank holding the store (rank 0) is frozen.
STORE_TIMEOUT_S = _STORE_TIMEOUT_S = 5.0


#: A watchdog thread that wakes this many seconds after its period counts the gap as the process's own freeze (the
#: whole process stopped: SIGSTOP, `scontrol suspend`), not as time its step took: a job resumed is not a hang.
_FROZEN_S = 2.0
#: Seconds a rank whose watchdog fired after another's waits for that rank's report before it ends quietly.
REPORT_WAIT_S = 30.0


def _round_prefix(round_: int) -> str:
    """The keys of one report (the claim, who is alive, where each rank is, "reported"): torchrun's agent store
    outlives a restart, and a claim left by an earlier round must not silence the next round's report."""
    return f"{_PREFIX}round-{round_}/"


def fired_key(round_: int) -> str:
    """The store key a rank claims when its watchdog fires first in torchrun's round `round_` (its rank)."""
    return _round_prefix(round_) + "fired"


def await_report(store: dist.TCPStore, round_: int, period_s: float, seconds: float = REPORT_WAIT_S) -> None:
    """Return once the rank reporting round `round_`'s hang has said its message (or within `seconds`, or when the
    store no longer answers: its host, rank 0's, ended)."""
    deadline = time.monotonic() + seconds
    key = _round_prefix(round_) + "reported"
    while time.monotonic() < deadline:
        if bounded(lambda: store.check([key]), 2 * _STORE_TIMEOUT_S) is not False:
            return
        time.sleep(period_s)


def beat_period(timeout_s: float) -> float:
    """Seconds between two heartbeats of a rank watched with `timeout_s` (--step-timeout)."""
    return min(1.0, timeout_s / 10)


@dataclass(frozen=True)
class Allowance:
    """A longer limit for long work: `seconds`, the `flag` that sets it, and `what` the work is (for the message)."""

    seconds: float
    what: str
    flag: str = "--save-timeout"


def waited_text(me: int, step: int, timeout_s: float, allowance: Allowance | None = None) -> str:
    """"rank R waited T s (--step-timeout) for step N to finish", or for the long work of `allowance`."""
    if allowance is not None:
        return f"rank {me} waited {allowance.seconds:g} s ({allowance.flag}) for {allowance.what} to finish"
    return f"rank {me} waited {timeout_s:g} s (--step-timeout) for step {step + 1} to finish"


def stuck_message(*, me: int, step: int, timeout_s: float, steps: dict[int, int], silent: dict[int, float],
                  allowance: Allowance | None = None) -> str:
    """Which ranks hold the job back: `silent` maps the ranks whose heartbeat stopped to the seconds since their
    last one; otherwise the ranks whose finished step (`steps`) is behind the others'. `allowance`: the long work
    this rank waited for (None: a step)."""
    waited = waited_text(me, step, timeout_s, allowance)
    if silent:
        names = ", ".join(f"rank {r} (last finished step {steps.get(r, 0)}, "
                          + (f"silent for {seconds:.0f} s)" if math.isfinite(seconds) else "never answered)")
                          for r, seconds in sorted(silent.items()))
        return f"{names} stopped responding (stopped or frozen process?); {waited}"
    lowest = min(steps.values()) if steps else step
    behind = sorted(r for r, s in steps.items() if s == lowest)
    if steps and lowest < max(steps.values()):
        return f"rank(s) {', '.join(map(str, behind))} stuck at step {lowest + 1} while others finished it; {waited}"
    where = f"step {step + 1}" if allowance is None else allowance.what
    return f"every rank is stuck in {where} (a collective that never completes?); {waited}"


class StepWatchdog:
    """Publishes this rank's finished step and a heartbeat to the job's TCP store; fires `on_stuck(message)`
    when `progress` has not been called for `timeout_s` seconds.

    The first rank to fire wins the right to report (one message per job); the others say where they are and end
    quietly once it has reported (a launcher that ends them sooner is welcome). When the store itself does not answer, the rank hosting it (rank 0) is frozen, or
    the link to its host is down.
    """

    def __init__(self, *, timeout_s: float, rank: int, world_size: int, master_addr: str, master_port: int,
                 on_stuck: Callable[[str], None], hang: HangReport | None = None, round_: int = 0) -> None:
        self.timeout_s = timeout_s
        self.rank = rank
        self.world_size = world_size
        self._on_stuck = on_stuck
        self._round = round_  # torchrun's restart count: the report's keys are this round's
        self._hang = hang
        self._store = dist.TCPStore(master_addr, master_port, is_master=False,
                                    timeout=timedelta(seconds=_STORE_TIMEOUT_S), wait_for_workers=False)
        self._step = 0
        self._last = time.monotonic()
        self._allowance: Allowance | None = None
        self._until_step = False  # the allowance ends with the next finished step (not with a block)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="pipetrain-watchdog", daemon=True)

    def start(self) -> None:
        self._last = time.monotonic()
        if self._hang is not None:
            self._hang.install()
            self._set(f"{_PREFIX}pid/{self.rank}", f"{socket.gethostname()} {os.getpid()}")
        self._beat()  # at once: a rank stopped before its thread's first period must still count as silent
        self._thread.start()

    def progress(self, step: int) -> None:
        """This rank finished `step` (or made other progress: evaluation, a save)."""
        self._last = time.monotonic()
        if step != self._step:
            if self._until_step:
                self._allowance, self._until_step = None, False
            self._step = step
            try:
                self._store.set(f"{_PREFIX}step/{self.rank}", str(step))
            except (RuntimeError, dist.DistStoreError):
                pass

    @property
    def limit_s(self) -> float:
        """The seconds this rank may go without progress now: the step timeout, or a long work's allowance."""
        return self.timeout_s if self._allowance is None else max(self.timeout_s, self._allowance.seconds)

    @contextmanager
    def during(self, seconds: float, what: str, flag: str = "--save-timeout") -> Iterator[None]:
        """Within the block (a save, a load), the limit is `seconds`; progress is counted from its start and end."""
        previous, until_step = self._allowance, self._until_step
        self._allowance, self._until_step = Allowance(seconds, what, flag), False
        self._last = time.monotonic()
        try:
            yield
        finally:
            self._allowance, self._until_step = previous, until_step
            self._last = time.monotonic()

    def until_next_step(self, seconds: float, what: str, flag: str = "--save-timeout") -> None:
        """The limit is `seconds` until the next step finishes (the first step: schedules built, compilation)."""
        self._allowance, self._until_step = Allowance(seconds, what, flag), True
        self._last = time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * _STORE_TIMEOUT_S)
        if self._hang is not None:
            self._hang.close()

    def _set(self, key: str, value: str) -> None:
        bounded(lambda: self._store.set(key, value), 2 * _STORE_TIMEOUT_S)

    @property
    def _waited(self) -> str:
        return waited_text(self.rank, self._step, self.timeout_s, self._allowance)

    @property
    def _period(self) -> float:
        return beat_period(self.timeout_s)

    def _watch(self) -> None:
        looked = 0.0  # when the heartbeats of the others were last read during long work
        woke = time.monotonic()
        while not self._stop.wait(self._period):
            now = time.monotonic()
            late, woke = now - woke - self._period, now
            if late > _FROZEN_S:  # this process was stopped (SIGSTOP, a suspended Slurm job): not its step's time
                self._last += late
            self._beat()
            if now - self._last > self.limit_s:
                self._fire()
                return
            allowance = self._allowance
            if allowance is not None and now - self._last > self.timeout_s and now - looked > self.timeout_s / 2:
                looked = now  # long work may last while every rank beats; a rank that stopped beating ends it
                if self._silent_peers():
                    self._allowance = Allowance(self.timeout_s, allowance.what, "--step-timeout")
                    self._fire()
                    return

    def _silent_peers(self) -> bool:
        """Whether another rank's heartbeat is older than the step timeout (stopped, frozen or dead)."""
        beats = bounded(lambda: self._read("beat"), 2 * _STORE_TIMEOUT_S)
        if beats is None:
            return True  # the store's host does not answer
        now = time.time()
        return any(now - float(beats.get(r, "-inf")) > self.timeout_s for r in range(self.world_size) if r != self.rank)

    def _beat(self) -> None:
        try:
            self._store.set(f"{HEARTBEAT_PREFIX}{self.rank}", repr(time.time()))
        except (RuntimeError, dist.DistStoreError):
            pass

    def _read(self, kind: str, *, per_round: bool = False) -> dict[int, str]:
        prefix = _round_prefix(self._round) if per_round else _PREFIX
        keys = {r: f"{prefix}{kind}/{r}" for r in range(self.world_size)}
        return {r: self._store.get(key).decode() for r, key in keys.items() if self._store.check([key])}

    def _fire(self) -> None:
        # say "alive" (a rank whose watchdog fires has stopped beating, but is no stopped process), then claim
        def claim_report() -> list[str]:
            self._store.set(f"{_round_prefix(self._round)}alive/{self.rank}", "1")
            return [self._store.compare_set(fired_key(self._round), "", str(self.rank)).decode()]

        claim = bounded(claim_report, 2 * _STORE_TIMEOUT_S)
        answer = None
        if claim is not None and claim[0] != str(self.rank):  # another rank reports: say where this one is, and go
            self._answer()
            answer = (False, "")
        elif claim is not None:
            answer = bounded(self._survey, 10 * self._period + 3 * _STORE_TIMEOUT_S)
        if answer is None:  # the store's host is frozen, gone, or cut off (a blackholed link blocks reads for good)
            winner = True
            message = (f"rank 0 (which holds the job's store) does not answer: it is stopped or frozen, or the link "
                       f"to its host is down; {self._waited}")
        else:
            winner, message = answer
        if winner:
            self._set(f"{_round_prefix(self._round)}reported", "1")  # the others may end now
            self._on_stuck(message)
        else:  # the winner reports (it needs this rank's gloo connections open until then), then this one ends
            await_report(self._store, self._round, self._period)
            self._on_stuck("")

    def _answer(self) -> None:
        """Write this rank's stacks, and where it is to the store (for the reporting rank)."""
        if self._hang is not None:
            self._set(f"{_round_prefix(self._round)}where/{self.rank}", encode(self._hang.dump()))

    def _survey(self) -> tuple[bool, str]:
        """This rank reports: tell the silent ranks from the live ones, gather where each is: (True, message)."""
        before = self._read("beat")
        start = time.monotonic()
        self._answer()
        time.sleep(max(0.0, 3 * self._period - (time.monotonic() - start)))  # live ranks beat; stopped ones do not
        after = self._read("beat")
        now = time.time()
        fired = set(self._read("alive", per_round=True))
        silent = {r: now - float(after[r]) if r in after else math.inf for r in range(self.world_size)
                  if r != self.rank and before.get(r) == after.get(r) and r not in fired}
        steps = {r: int(value) for r, value in self._read("step").items()}
        message = stuck_message(me=self.rank, step=self._step, timeout_s=self.timeout_s, steps=steps, silent=silent,
                                allowance=self._allowance)
        if self._hang is None:
            return True, message
        live = set(range(self.world_size)) - set(silent)
        for _ in range(5):  # the live ranks fire within a period or two of this one: wait for their answers
            wheres = {r: decode(text) for r, text in self._read("where", per_round=True).items()}
            if live <= set(wheres):
                break
            time.sleep(self._period)
        self._signal_mute(live - set(wheres))
        said = hang_message(wheres)
        if said and not silent and not all(waiting for waiting, _ in wheres.values()):  # one rank is elsewhere
            message = f"{said}; {self._waited}"
        elif said:
            message = f"{message}; {said}"
        folder = self._hang.folder
        files = f"; stacks of every rank that answered in {folder}" if folder is not None else ""
        return True, message + files

    def _signal_mute(self, ranks: set[int]) -> None:
        """Ask the ranks of this host that did not answer (their watchdog thread cannot run) to dump their stacks."""
        here = socket.gethostname()
        for r, text in self._read("pid").items():
            host, _, pid = text.rpartition(" ")
            if r in ranks and host == here:
                try:
                    os.kill(int(pid), DUMP_SIGNAL)
                except OSError:
                    pass
        if ranks:
            time.sleep(self._period)


def bounded(ask: Callable[[], T], seconds: float) -> T | None:
    """`ask()` run in a helper thread, or None when it raised a store error or gave no answer within `seconds`.

    A store read over a link that drops packets (no reset) blocks past the store's own timeout; the helper
    thread, a daemon, is abandoned then.
    """
    answer: list[T] = []

    def run() -> None:
        try:
            answer.append(ask())
        except (RuntimeError, dist.DistStoreError):
            pass

    helper = threading.Thread(target=run, name="pipetrain-store-query", daemon=True)
    helper.start()
    helper.join(seconds)
    return answer[0] if answer else None

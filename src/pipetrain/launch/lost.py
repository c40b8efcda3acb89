"""After a lost connection: which ranks are gone, read from the step watchdog's heartbeats, said by one rank.

When a host dies (its processes killed, the machine lost), every rank that talked to it sees its connection
closed at once; each would print the same unhelpful "connection closed by peer", none naming who is gone. The
ranks still alive keep beating in the job's store (launch/watchdog.py), the lost ones stopped: the first rank to
claim the report compares two readings of the heartbeats and names the silent ranks; the others stay quiet.

torchrun's agent store outlives a restart, and a claim left by an earlier round would silence the report of the
next loss (a later elastic round's): the claim and the "saw it" marks are kept under the round's own keys
(`elastic_round`), and they carry the wall-clock time they were made and count for `_CLAIM_LIFE_S` only (a store
kept by something else than torchrun).
"""

from __future__ import annotations

import math
import time
from datetime import timedelta

import torch.distributed as dist

from pipetrain.errors import RankFailedError
from pipetrain.launch.env import elastic_restarts_left, elastic_round
from pipetrain.launch.failures import error_text
from pipetrain.launch.spawn import RankSpec, fail_now
from pipetrain.launch.watchdog import (
    HEARTBEAT_PREFIX,
    REPORT_WAIT_S,
    STORE_TIMEOUT_S,
    await_report,
    beat_period,
    bounded,
    fired_key,
)

__all__ = ["LOST_CONNECTION", "lost_hint", "lost_ranks_message", "report_lost_connection", "silent_ranks"]

_CLAIM = "pipetrain/lost/reporter"
#: Key prefix: rank r saw a lost connection itself (it is alive; its watchdog stops beating as it ends).
_SAW = "pipetrain/lost/saw/"
#: What gloo says when a peer's connection closes (its process died, or its host).
LOST_CONNECTION = ("Connection closed by peer", "Connection reset by peer")
#: Seconds a rank that leaves the report to another waits before ending quietly (the launcher ends it sooner).
_QUIET_S = 20.0
#: Seconds a claim or a "saw it" mark counts for: longer than one report takes (a few heartbeat periods and store
#: timeouts), shorter than a restart of the job takes (a new rendezvous, the model built again).
_CLAIM_LIFE_S = 30.0


def report_lost_connection(err: BaseException, spec: RankSpec, *, step_timeout_s: float | None) -> RankFailedError | None:
    """The error naming the lost ranks when `err` is a lost connection and this rank reports it; None when `err`
    is something else. A rank that leaves the report to another sleeps, then ends without a word."""
    text = error_text(err)
    if not any(needle in text for needle in LOST_CONNECTION):
        return None
    period = beat_period(step_timeout_s) if step_timeout_s else 1.0
    if _watchdog_reports(spec, period):
        fail_now("")  # the hang was named first; this closed connection is the reporter (or another) ending
    message = lost_ranks_message(me=spec.rank, world_size=spec.world_size, master_addr=spec.master_addr,
                                 master_port=spec.master_port, beat_period_s=period, restart_count=elastic_round())
    if message is None:
        time.sleep(_QUIET_S)
        fail_now("")
    return RankFailedError(message, hint=lost_hint(elastic_restarts_left()))


def _watchdog_reports(spec: RankSpec, period_s: float) -> bool:
    """Whether a step watchdog already names this round's hang (then wait for its message, up to its bound): the
    connection this rank saw close is then a rank ending after the hang, not a lost one."""
    def ask() -> bool:
        store = dist.TCPStore(spec.master_addr, spec.master_port, is_master=False,
                              timeout=timedelta(seconds=STORE_TIMEOUT_S), wait_for_workers=False)
        if not store.check([fired_key(elastic_round())]):
            return False
        await_report(store, elastic_round(), period_s)
        return True

    return bool(bounded(ask, REPORT_WAIT_S + 3 * STORE_TIMEOUT_S))


def lost_hint(restarts_left: int | None) -> str:
    """What to do after a lost host: run again with --resume, or, under torchrun's elastic agent with restarts left,
    nothing (it restarts the job by itself; `restarts_left` None: not under torchrun)."""
    if restarts_left:
        return (f"torchrun restarts the job by itself ({restarts_left} restart{'s' if restarts_left > 1 else ''} "
                "left): started with --resume, it continues from the last complete checkpoint")
    if restarts_left == 0:
        return ("torchrun has no restart left (--max-restarts): restart the lost host (or leave it out), then run "
                "again with --resume to continue from the last complete checkpoint")
    return "restart the lost host (or leave it out), then run again with --resume to continue from the last complete " \
           "checkpoint"


def _keys(round_: int) -> tuple[str, str]:
    """(the claim's key, the "saw it" marks' prefix) of torchrun's round `round_` (the first round's are those
    older pipetrain wrote)."""
    return (_CLAIM, _SAW) if round_ == 0 else (f"{_CLAIM}/{round_}", f"{_SAW}{round_}/")


def _claim(store: dist.TCPStore, key: str, me: int, now: float) -> bool:
    """Whether this rank wins the report: the claim `key` is free, or stale (older than `_CLAIM_LIFE_S`)."""
    mine = f"{me} {now!r}"
    held = store.compare_set(key, "", mine).decode()
    if held == mine:
        return True
    if _age(held, now) <= _CLAIM_LIFE_S:
        return False
    return store.compare_set(key, held, mine).decode() == mine  # a stale claim: take it (one rank wins)


def _age(mark: str, now: float) -> float:
    """Seconds since a claim or mark ("RANK TIME" or "TIME") was made; inf for one without a time (older code)."""
    try:
        return now - float(mark.split()[-1])
    except (ValueError, IndexError):
        return float("inf")


def silent_ranks(before: dict[int, str], after: dict[int, str], *, world_size: int, me: int,
                 now: float) -> dict[int, float]:
    """The ranks whose heartbeat did not change between two readings, with the seconds since their last beat
    (inf: never beat). Pure: the readings map ranks to the beat's wall-clock time as text."""
    return {r: now - float(after[r]) if r in after else math.inf
            for r in range(world_size) if r != me and before.get(r) == after.get(r)}


def lost_ranks_message(*, me: int, world_size: int, master_addr: str, master_port: int,
                       beat_period_s: float, restart_count: int = 0) -> str | None:
    """The one message naming the ranks that are gone, if this rank is the one to say it; None if another rank
    claimed the report of torchrun's round `restart_count` (stay quiet: the launcher ends this rank when the
    reporter exits).

    Takes about 3 heartbeat periods (the live ranks beat meanwhile). When the store itself does not answer, the
    host of rank 0, which holds it, is the one gone, and every rank that notices says so.
    """
    claim, saw_prefix = _keys(restart_count)

    def survey() -> tuple[dict[int, str], dict[int, str], set[int]] | None:
        store = dist.TCPStore(master_addr, master_port, is_master=False,
                              timeout=timedelta(seconds=STORE_TIMEOUT_S), wait_for_workers=False)
        now = time.time()
        store.set(f"{saw_prefix}{me}", repr(now))  # alive, and ending: a rank that failed stops beating, it is not lost
        if not _claim(store, claim, me, now):
            return None
        keys = {r: f"{HEARTBEAT_PREFIX}{r}" for r in range(world_size)}
        first = {r: store.get(k).decode() for r, k in keys.items() if store.check([k])}
        time.sleep(3 * beat_period_s)
        second = {r: store.get(k).decode() for r, k in keys.items() if store.check([k])}
        marks = {r: store.get(f"{saw_prefix}{r}").decode() for r in range(world_size)
                 if store.check([f"{saw_prefix}{r}"])}
        saw = {r for r, mark in marks.items() if _age(mark, time.time()) <= _CLAIM_LIFE_S}
        return first, second, saw

    answer = bounded(lambda: [survey()], 3 * beat_period_s + 2 * STORE_TIMEOUT_S)
    if answer is None:
        return (f"rank {me} lost its connection to the other ranks, and the job's store on {master_addr}:"
                f"{master_port} does not answer either: the host of rank 0 is gone (killed, or its link is down)")
    if answer[0] is None:
        return None
    before, after, saw = answer[0]
    if not before:
        return (f"rank {me} lost its connection to another rank, which probably died (no heartbeats to tell "
                "which: the step watchdog is off with --step-timeout 0)")
    silent = {r: t for r, t in silent_ranks(before, after, world_size=world_size, me=me, now=time.time()).items()
              if r not in saw}
    if not silent:
        return f"rank {me} lost its connection to another rank, but every rank still beats (a network fault?)"
    names = ", ".join(map(str, sorted(silent)))
    last = max(seconds for seconds in silent.values() if math.isfinite(seconds)) if any(
        math.isfinite(s) for s in silent.values()) else math.inf
    since = f"no heartbeat for {last:.0f} s" if math.isfinite(last) else "never beat"
    return (f"lost rank{'s' if len(silent) > 1 else ''} {names} of {world_size} ({since}: their processes were "
            f"killed or their host is gone); rank {me} saw its connection to them close")

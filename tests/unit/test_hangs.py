"""Hang reports, without processes: where a thread is (waiting in torch.distributed, or computing, with the
pipeline action), the message naming who did not arrive, and the rank's file (written on a dump, removed empty)."""

from __future__ import annotations

import os
import sys

from pipetrain.compat.modules import flight_record
from pipetrain.launch.env import enable_flight_recorder
from pipetrain.launch.hangs import DUMP_SIGNAL, HangReport, decode, encode, hang_message, where


def test_a_thread_computing_outside_torch_distributed_runs_there():
    waiting, text = where(sys._getframe())
    assert not waiting and text.startswith("runs test_a_thread_computing_outside_torch_distributed_runs_there "
                                           "(test_hangs.py:")


def test_a_frame_of_torch_distributed_waits_there_during_the_pipeline_action():
    namespace: dict = {}
    code = "def _wait_batch_p2p(action):\n    import sys\n    return sys._getframe()\n"
    exec(compile(code, os.path.join(os.sep, "venv", "torch", "distributed", "pipelining", "schedules.py"), "exec"),
         namespace)
    waiting, text = where(namespace["_wait_batch_p2p"]("1F3"))
    assert waiting and text == "waits in torch.distributed _wait_batch_p2p (schedules.py:3) during pipeline action 1F3"
    assert decode(encode((waiting, text))) == (waiting, text)


def test_the_message_names_the_rank_that_did_not_arrive_and_groups_the_waiting_ones():
    recv, wait = "waits in torch.distributed recv (x.py:1)", "waits in torch.distributed wait (y.py:2)"
    wheres = {0: (True, recv), 1: (False, "runs forward (model.py:12)"), 2: (True, recv), 3: (True, wait)}
    assert hang_message(wheres) == ("rank 1 did not arrive: it runs forward (model.py:12); ranks 0, 2 waits in "
                                    "torch.distributed recv (x.py:1); rank 3 waits in torch.distributed wait (y.py:2)")
    assert hang_message({}) == ""


def test_the_file_holds_every_thread_stack_after_a_dump_and_is_gone_without_one(tmp_path):
    report = HangReport(tmp_path / "hang", rank=2)
    report.install()
    waiting, _ = report.dump()
    report.close()
    text = (tmp_path / "hang" / "rank-2.txt").read_text()
    assert not waiting and text.startswith(f"rank 2 on {report.host} (pid {os.getpid()}) runs ")
    assert "in test_the_file_holds_every_thread_stack_after_a_dump_and_is_gone_without_one" in text

    quiet = HangReport(tmp_path / "quiet", rank=0)
    quiet.install()
    quiet.close()
    assert not (tmp_path / "quiet").exists()


def test_the_signal_dumps_a_rank_whose_watchdog_cannot(tmp_path):
    report = HangReport(tmp_path, rank=0)
    report.install()
    try:  # what `kill -USR2 PID` (or the reporting rank) does; a signal sent to oneself arrives before kill returns
        os.kill(os.getpid(), DUMP_SIGNAL)
    finally:
        report.close()
    text = (tmp_path / "rank-0.txt").read_text()
    assert "Current thread" in text and "in test_the_signal_dumps_a_rank_whose_watchdog_cannot" in text, text


def test_the_flight_recorder_is_turned_on_and_a_user_setting_kept(monkeypatch):
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE"):
        monkeypatch.delenv(name, raising=False)  # restored (removed) after the test
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "50")
    assert enable_flight_recorder("/runs/x/hang/nccl-timeout-rank-") == {
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_DUMP_TEMP_FILE": "/runs/x/hang/nccl-timeout-rank-"}
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "50"
    assert flight_record("gloo") is None  # NCCL's only


def test_long_work_has_its_own_limit_and_is_named_when_it_runs_out():
    """A save within --save-timeout does not fire the step watchdog; one past it is named as the save; the first
    step's allowance ends with it. One rank, an in-process store, 0.5 s step timeout."""
    import threading
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from pipetrain.launch.watchdog import StepWatchdog

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    said: list[str] = []
    fired = threading.Event()
    dog = StepWatchdog(timeout_s=0.5, rank=0, world_size=1, master_addr="127.0.0.1", master_port=store.port,
                       on_stuck=lambda message: (said.append(message), fired.set()))
    dog.start()
    try:
        dog.until_next_step(3.0, "step 1, the first (schedules built, compilation)")
        time.sleep(1.2)  # a long first step: within its allowance
        dog.progress(1)
        assert dog.limit_s == 0.5 and not said
        with dog.during(3.0, "the save of checkpoint step 1"):
            time.sleep(1.2)  # a save longer than the step timeout, within --save-timeout
        assert not said and dog.limit_s == 0.5
        with dog.during(0.8, "the save of checkpoint step 1"):
            assert fired.wait(10.0)
    finally:
        dog.stop()
    assert said == ["every rank is stuck in the save of checkpoint step 1 (a collective that never completes?); rank 0 "
                    "waited 0.8 s "
                    "(--save-timeout) for the save of checkpoint step 1 to finish"], said


def test_a_silent_rank_ends_long_work_after_the_step_timeout():
    """A save may last past --step-timeout while every rank beats; a rank whose heartbeat stopped (SIGSTOP, a dead
    host) ends it after the step timeout, not after --save-timeout."""
    import threading
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from pipetrain.launch.watchdog import HEARTBEAT_PREFIX, StepWatchdog

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    store.set(HEARTBEAT_PREFIX + "1", repr(time.time()))  # rank 1 beat once, then stopped
    said: list[str] = []
    fired = threading.Event()
    dog = StepWatchdog(timeout_s=0.5, rank=0, world_size=2, master_addr="127.0.0.1", master_port=store.port,
                       on_stuck=lambda message: (said.append(message), fired.set()))
    dog.start()
    try:
        start = time.monotonic()
        with dog.during(60.0, "the save of checkpoint step 4"):
            assert fired.wait(20.0)
        assert time.monotonic() - start < 20.0
    finally:
        dog.stop()
    assert len(said) == 1 and said[0].startswith("rank 1 (last finished step 0, silent for "), said
    assert said[0].endswith("stopped responding (stopped or frozen process?); rank 0 waited 0.5 s (--step-timeout) "
                            "for the save of checkpoint step 4 to finish"), said


def test_the_second_rank_to_fire_ends_once_the_first_has_reported_and_an_earlier_round_silences_none():
    """Two ranks stuck together (both wait on a dead host gloo did not report): one names the hang, the other ends
    quietly as soon as that is said, not 30 s later (torchrun's SIGTERM cannot reach a rank blocked in a collective).
    A claim left in the store by torchrun's earlier round does not keep this round's watchdog quiet."""
    import threading
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from pipetrain.launch.watchdog import REPORT_WAIT_S, StepWatchdog, fired_key

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    store.set(fired_key(0), "3")  # round 0's report (by its rank 3, of 4), made before torchrun restarted the job
    said: dict[int, str] = {}
    both = threading.Barrier(3)

    def ended(rank: int):
        def on_stuck(message: str) -> None:
            said[rank] = message
            both.wait(timeout=REPORT_WAIT_S)
        return on_stuck

    dogs = [StepWatchdog(timeout_s=0.5, rank=r, world_size=2, master_addr="127.0.0.1", master_port=store.port,
                         on_stuck=ended(r), round_=1) for r in (0, 1)]
    start = time.monotonic()
    for dog in dogs:
        dog.start()
    try:
        both.wait(timeout=REPORT_WAIT_S)  # both ended: the quiet one well before REPORT_WAIT_S
        took = time.monotonic() - start
    finally:
        for dog in dogs:
            dog.stop()
    messages = sorted(said.values())
    assert messages[0] == "" and messages[1].startswith("every rank is stuck in step 1"), said
    assert took < REPORT_WAIT_S / 2, took


_FROZEN_CHILD = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
from pipetrain.launch.watchdog import StepWatchdog
def spin(n):  # a step's work: a fixed amount of it, so that a step stopped halfway still has work left when resumed
    total = 0
    for i in range(n):
        total += i
    return total
start, n = time.perf_counter(), 200_000
spin(n)
n = int(n * 0.3 / max(time.perf_counter() - start, 1e-6))  # about 0.3 s of work per step
store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
def fired(message):
    print("FIRED", message, flush=True)
    sys.exit(3)
dog = StepWatchdog(timeout_s=2.0, rank=0, world_size=1, master_addr="127.0.0.1", master_port=store.port,
                   on_stuck=fired)
dog.start()
print("READY", flush=True)
for step in range(1, 5):
    spin(n)
    dog.progress(step)
dog.stop()
print("DONE", flush=True)
"""


def test_a_process_stopped_and_resumed_is_no_hang(tmp_path):
    """A job suspended as a whole (SIGSTOP, Slurm's `scontrol suspend`) and resumed goes on: its watchdog counts the
    time the process stood still as its own freeze, not as a step that took 3.5 s against a 2 s --step-timeout."""
    import os
    import signal
    import subprocess
    import sys
    import time

    child = subprocess.Popen([sys.executable, "-c", _FROZEN_CHILD], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert child.stdout.readline().strip() == "READY"
        time.sleep(0.2)  # within the first step
        child.send_signal(signal.SIGSTOP)
        time.sleep(3.5)
        child.send_signal(signal.SIGCONT)
        out, _ = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 0 and out.strip() == "DONE", (child.returncode, out)

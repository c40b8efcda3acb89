"""A rank's lifeline (launch/lifeline.py) with plain pipes and small Python processes, no torch: EOF on the launcher's
pipe ends the rank with one line naming the launcher; a rank whose parent (torchrun's agent) is SIGKILLed ends
within a second or so. The whole-job kills are in tests/distributed/test_orphans.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

from pipetrain.launch.env import under_torchrun_agent
from pipetrain.launch.lifeline import Lifeline, watch_fd


def test_the_lifeline_reads_eof_when_the_launcher_end_closes():
    ended: list[tuple[str, bool]] = []
    done = threading.Event()
    lifeline = Lifeline()
    reader = os.dup(lifeline.reader)  # the rank's copy
    watch_fd(reader, rank=2, launcher=1234, say=True, end=lambda message, say: (ended.append((message, say)),
                                                                                done.set()))
    time.sleep(0.2)
    assert not ended  # the launcher lives
    lifeline.close()
    assert done.wait(5.0)
    assert ended == [("the launcher of this job (pid 1234) is gone (killed?): rank 2 and the others it started end "
                      "too", True)]
    os.close(reader)


def test_a_rank_ends_when_its_parent_agent_is_killed(tmp_path):
    rank = textwrap.dedent("""
        import time
        from pipetrain.launch.lifeline import watch_parent
        watch_parent(rank=3, say=True)
        print("watching", flush=True)
        time.sleep(120)
    """)
    agent = textwrap.dedent(f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", {rank!r}], stderr=open({str(tmp_path / 'err.txt')!r}, "w"),
                                 stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline() == "watching\\n"
        print(child.pid, flush=True)
        time.sleep(120)
    """)
    parent = subprocess.Popen([sys.executable, "-c", agent], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        child = int(parent.stdout.readline())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        start = time.monotonic()
        while _runs(child) and time.monotonic() - start < 10:
            time.sleep(0.05)
        assert not _runs(child), "the rank outlived its agent"
    finally:
        try:
            os.killpg(parent.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    said = (tmp_path / "err.txt").read_text()
    assert said == (f"pipetrain: error: torchrun's agent (pid {parent.pid}), which started this rank, is gone (killed?): "
                    "rank 3 ends too\n"), said


def _runs(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_only_a_process_of_torchruns_agent_watches_it():
    assert under_torchrun_agent({"TORCHELASTIC_RUN_ID": "none"}) and not under_torchrun_agent({"RANK": "0"})

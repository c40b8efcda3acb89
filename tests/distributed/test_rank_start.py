"""Ranks forked from the fork server (launch/forkserver.py) start as spawned ones would: with the launcher's
environment, working directory and standard streams as they are when the job starts, not as they were when the
server started (an earlier job of the same process), and with the launcher's start as their job's start;
PIPETRAIN_START_METHOD=spawn starts each rank as a fresh interpreter instead, on the same terms."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from pipetrain.errors import LaunchError
from pipetrain.launch.env import start_method
from pipetrain.launch.forkserver import context
from pipetrain.launch.spawn import RankSpec, launch_local


def _describe(spec: RankSpec, out: str) -> None:
    Path(out, f"rank{spec.rank}.json").write_text(json.dumps(
        {"probe": os.environ.get("PIPETRAIN_TEST_PROBE"), "cwd": os.getcwd(), "launched_at": spec.launched_at,
         "parent": os.getppid()}))
    print(f"rank {spec.rank} on stdout", flush=True)
    print(f"rank {spec.rank} on stderr", file=sys.stderr, flush=True)


def test_a_second_job_sees_the_launcher_as_it_is_now(tmp_path, monkeypatch, capfd):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    monkeypatch.setenv("PIPETRAIN_TEST_PROBE", "first")
    monkeypatch.chdir(first)
    with open(first / "output.log", "w") as log, _streams_to(log.fileno()):  # the first job writes elsewhere
        launch_local(_describe, 2, str(first))
    monkeypatch.setenv("PIPETRAIN_TEST_PROBE", "second")
    monkeypatch.chdir(second)
    begun = time.clock_gettime(time.CLOCK_BOOTTIME)
    launch_local(_describe, 2, str(second))
    out, err = capfd.readouterr()
    for rank in (0, 1):
        seen = json.loads((second / f"rank{rank}.json").read_text())
        assert seen["probe"] == "second" and Path(seen["cwd"]) == second
        # its start-up counts from its own launch, not from this process's start (nor the first job's launch)
        assert begun - 0.02 <= seen["launched_at"] <= begun + 10.0
        assert seen["parent"] != os.getpid()  # forked by the server, not by this process
        assert f"rank {rank} on stdout" in out and f"rank {rank} on stderr" in err
        assert json.loads((first / f"rank{rank}.json").read_text())["probe"] == "first"
    assert out.count("on stdout") == 2  # the first job's lines went where its launcher's went
    assert (first / "output.log").read_text().count("on stdout") == 2


def test_spawn_on_request_starts_each_rank_from_this_process(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("PIPETRAIN_START_METHOD", "spawn")
    monkeypatch.setenv("PIPETRAIN_TEST_PROBE", "spawned")
    launch_local(_describe, 2, str(tmp_path))
    out, _ = capfd.readouterr()
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["parent"] == os.getpid() and seen["probe"] == "spawned"
        assert f"rank {rank} on stdout" in out


def test_start_method_values(monkeypatch):
    assert start_method({}) == "forkserver" and start_method({"PIPETRAIN_START_METHOD": " Spawn "}) == "spawn"
    with pytest.raises(LaunchError, match="PIPETRAIN_START_METHOD='fork' is not a start method"):
        start_method({"PIPETRAIN_START_METHOD": "fork"})
    assert context("cpu").get_start_method() == "forkserver"
    assert context("cuda").get_start_method() == "spawn"  # CUDA ranks: fresh interpreters (see forkserver.py)
    monkeypatch.setenv("PIPETRAIN_START_METHOD", "spawn")
    assert context("cpu").get_start_method() == "spawn"


@contextmanager
def _streams_to(fd: int) -> Iterator[None]:
    """Standard output and error of this process go to `fd` within the block."""
    saved = {target: os.dup(target) for target in (1, 2)}
    try:
        for target in saved:
            os.dup2(fd, target)
        yield
    finally:
        for target, copy in saved.items():
            os.dup2(copy, target)
            os.close(copy)


def _draw(spec: RankSpec, out: str) -> None:
    import numpy
    import torch

    Path(out).mkdir(exist_ok=True)
    Path(out, f"rank{spec.rank}.json").write_text(json.dumps({"torch": torch.randn(2).tolist(),
                                                              "numpy": numpy.random.rand(2).tolist()}))


def test_forked_ranks_draw_random_numbers_of_their_own(tmp_path):
    """As fresh interpreters (torch seeds its generator from the OS at start): no two ranks, of one job or of
    two, draw the same numbers from torch's or numpy's global generator."""
    launch_local(_draw, 2, str(tmp_path / "a"))
    launch_local(_draw, 2, str(tmp_path / "b"))
    draws = [json.loads((tmp_path / job / f"rank{rank}.json").read_text()) for job in "ab" for rank in (0, 1)]
    for generator in ("torch", "numpy"):
        assert len({tuple(draw[generator]) for draw in draws}) == 4, draws

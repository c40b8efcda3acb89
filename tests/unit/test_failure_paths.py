"""After a rank fails: its report comes before any teardown, the teardown never blocks (NCCL's destroy can hang on
the failed work: the group is aborted), the collectives' timeout lies above --step-timeout, and NCCL's failure
messages and a SIGABRT get their own line and hint. No process group is needed: torch.distributed is patched."""

from __future__ import annotations

import json
import signal
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from pipetrain.train import loop as trainer
from pipetrain.bench import cell as cell_mod
from pipetrain.bench.grid import Cell
from pipetrain.checkpoint.durable import DurableConfig
from pipetrain.launch.failures import backend_failure, signal_hint
from pipetrain.launch.rank_reports import first_failure
from pipetrain.launch.spawn import RankSpec
from pipetrain.parallel.mesh import PRIVATE_C10D, leave_after_error

SPEC = RankSpec(0, 0, 2, "127.0.0.1", 1, "cpu")


def test_private_c10d_names_still_exist():
    for name in PRIVATE_C10D:
        assert callable(getattr(distributed_c10d, name)), f"torch moved distributed_c10d.{name}: update parallel/mesh.py"


@pytest.mark.parametrize("backend, done", [("nccl", "aborted"), ("gloo", "left")])
def test_leaving_after_an_error_never_destroys(monkeypatch, backend, done):
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *a: backend)
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a: calls.append("destroy"))
    monkeypatch.setattr(distributed_c10d, "_abort_process_group", lambda *a: calls.append("abort"))
    assert leave_after_error() == done
    assert calls == (["abort"] if backend == "nccl" else [])


def test_not_joined_is_nothing_to_leave():
    assert leave_after_error() == "none"


def test_a_bench_cell_reports_oom_before_leaving_the_group(monkeypatch, tmp_path):
    order = []

    def oom(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def close(*, after_error: bool = False):
        order.append(("close", after_error, (tmp_path / "rank0.json").exists()))

    monkeypatch.setattr(cell_mod, "_measure", oom)
    monkeypatch.setattr(cell_mod, "close_session", close)
    cell = Cell(pp=2, dp=1, batch_size=8, chunks=2, schedule="gpipe", checkpoint="never", preset="tiny")
    with pytest.raises(torch.OutOfMemoryError):
        cell_mod.measure_rank(SPEC, cell, 0, 1, str(tmp_path))
    assert order == [("close", True, True)]  # after the report, and as an error's (non-blocking) leave
    assert json.loads((tmp_path / "rank0.json").read_text())["status"] == "oom"


def test_train_rank_leaves_without_blocking_after_an_error_and_ties_the_timeout(monkeypatch):
    seen = {}

    class Broken:
        @property
        def engine(self):
            raise RuntimeError("CUDA out of memory")

    def fake_open(*args, **kwargs):
        seen["timeout_s"] = kwargs.get("timeout_s")
        return Broken()

    monkeypatch.setattr(trainer, "open_session", fake_open)
    monkeypatch.setattr(trainer, "close_session", lambda *, after_error=False: seen.setdefault("after_error", after_error))
    config = trainer.TrainConfig(preset="tiny", data="synthetic", train_samples=8, test_samples=8, batch_size=4,
                                 durable=DurableConfig(step_timeout_s=900))
    with pytest.raises(RuntimeError, match="out of memory"):
        trainer.train_rank(SPEC, config, trainer.load_data(config))
    assert seen == {"timeout_s": 1800.0, "after_error": True}


def test_process_group_timeout_is_above_the_step_timeout():
    assert DurableConfig(step_timeout_s=300).process_group_timeout_s == 600.0
    assert DurableConfig(step_timeout_s=1200).process_group_timeout_s == 2400.0
    assert DurableConfig(step_timeout_s=None).process_group_timeout_s == 600.0


@pytest.mark.parametrize("text, expected", [
    ("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE) ran for 600000 "
     "milliseconds before timing out.", "did not complete within the process-group timeout"),
    ("NCCL communicator was aborted on rank 0.", "NCCL communicator was aborted"),
    ("ncclInvalidUsage: Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1a000", "two ranks"),
    ("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234", "lost its connection"),
])
def test_backend_messages_become_one_line(text, expected):
    known = backend_failure(RuntimeError(text), 1)
    assert known is not None and expected in known.message and known.hint
    assert backend_failure(RuntimeError("shape mismatch in mat1"), 1) is None  # a bug keeps its traceback


def test_sigabrt_has_its_own_hint():
    assert "NCCL's watchdog" in signal_hint("SIGABRT") and "out of memory" in signal_hint("SIGKILL")
    dead = SimpleNamespace(exitcode=-signal.SIGABRT, name="pipetrain-rank1")
    err = first_failure([], [(1, dead)])
    assert "code -6 (SIGABRT)" in err.message and "NCCL's watchdog" in err.hint
    assert "out of memory" in first_failure([], [(1, SimpleNamespace(exitcode=-9, name="r"))]).hint


def test_a_peer_lost_during_a_save_is_named_as_lost_not_as_a_failed_save(monkeypatch, tmp_path):
    """A host killed while a checkpoint is being written: the save's error (a RankFailedError whose cause is gloo's
    closed connection) goes through the lost-rank report like a lost connection in a step: one rank names the lost
    ranks, the others stay quiet (it was two "the save of checkpoint ... failed" lines, one per surviving rank, and
    no lost rank named: the multihost kill test's flake). Any other save failure keeps its own message."""
    from pipetrain.checkpoint.state import save_failed
    from pipetrain.cli import train_run as train_cli
    from pipetrain.errors import RankFailedError

    lost = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.213.7.2]:19081")
    named = RankFailedError("lost ranks 2, 3 of 4")
    asked = []

    def report(err, spec, *, step_timeout_s):
        asked.append(str(err))
        return named if "Connection closed by peer" in str(err) else None

    monkeypatch.setattr(train_cli, "report_lost_connection", report)
    config = SimpleNamespace(durable=SimpleNamespace(step_timeout_s=60.0))
    for cause, expected in ((lost, named), (RuntimeError("Something else"), None)):
        failed = save_failed(tmp_path / "step-00000012", cause)
        monkeypatch.setattr(train_cli, "train_rank", lambda *a, failed=failed: (_ for _ in ()).throw(failed))
        with pytest.raises(RankFailedError) as raised:
            train_cli._rank_main(SPEC, config, None, None)
        assert raised.value is (expected or failed), raised.value
    assert len(asked) == 2 and "the save of checkpoint" in asked[0], asked

"""What the fork server imports before it forks (launch/forkserver.py): its own preloads, then the modules a launcher
asked for with `preload_also` (the test suite: transformers and its kin, tests/conftest.py; `pipetrain` for a
Hugging Face model's ranks), then its set-up, last. Checked on the list handed to multiprocessing (no server is
started)."""

from __future__ import annotations

import pytest

from pipetrain.cli import main as cli_main
from pipetrain.launch import forkserver
from pipetrain.workloads.hf import RANK_IMPORTS


class _Recorder:
    def __init__(self) -> None:
        self.preload: list[str] | None = None

    def set_forkserver_preload(self, modules: list[str]) -> None:
        self.preload = modules


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> _Recorder:
    recorder = _Recorder()
    monkeypatch.setattr(forkserver.mp, "get_context", lambda method: recorder)
    monkeypatch.setattr(forkserver, "_ALSO", [])
    return recorder


def test_modules_preloaded_too_come_before_the_servers_set_up_once_each(recorded):
    forkserver.preload_also("colorsys", "torch", "wave", "colorsys")
    forkserver.context("cpu", "forkserver")
    setup = forkserver.PRELOAD[-1]
    assert setup == "pipetrain.launch.forkserver_setup"
    assert recorded.preload == [*forkserver.PRELOAD[:-1], "colorsys", "wave", setup]


def test_without_a_request_the_server_imports_its_own_preloads(recorded):
    forkserver.context("cpu", "forkserver")
    assert recorded.preload == list(forkserver.PRELOAD)


@pytest.mark.parametrize("argv, hf", [
    (["train", "--workload", "hf", "--pp", "2"], True),
    (["check", "--workload=hf"], True),
    (["eval", "--checkpoint", "ck"], True),
    (["generate", "--model", "folder"], True),
    (["train", "--workload", "hf", "--workload", "lm"], False),  # the last one wins, as argparse has it
    (["train", "--preset", "tiny"], False),
    (["plan", "--workload", "hf"], False),  # starts no rank
    (["train", "--workload", "hf", "--help"], False),
])
def test_a_hugging_face_command_has_its_server_import_transformers(argv, hf, recorded, monkeypatch):
    monkeypatch.setattr(cli_main, "warm_up", lambda: None)
    cli_main._start_rank_server(argv)
    assert forkserver._ALSO == (list(RANK_IMPORTS) if hf else []), argv

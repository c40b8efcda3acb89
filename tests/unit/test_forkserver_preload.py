"""What the fork server imports before it forks (launch/forkserver.py): its own preloads, then the modules a launcher
asked for with `preload_also` (the test suite: transformers and its kin, tests/conftest.py), then its set-up, last.
Checked on the list handed to multiprocessing (no server is started)."""

from __future__ import annotations

import pytest

from pipetrain.launch import forkserver


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

"""Every test outside tests/gpu runs its ranks on the CPU (gloo), even on a GPU node: the tolerances and the
backend the CPU tier asserts are the CPU's. tests/gpu/conftest.py pins its tier to CUDA instead."""

from __future__ import annotations

import pytest

from pipetrain.launch.env import DEVICE_VARIABLE


@pytest.fixture(autouse=True)
def pinned_device(monkeypatch: pytest.MonkeyPatch) -> str:
    """The device type this tier's ranks run on (PIPETRAIN_DEVICE, inherited by spawned ranks and subprocesses)."""
    monkeypatch.setenv(DEVICE_VARIABLE, "cpu")
    return "cpu"

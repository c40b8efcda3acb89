"""The GPU tier runs its ranks on CUDA (NCCL); its tests skip themselves where CUDA (or enough GPUs) is missing."""

from __future__ import annotations

import pytest

from pipetrain.launch.env import DEVICE_VARIABLE


@pytest.fixture(autouse=True)
def pinned_device(monkeypatch: pytest.MonkeyPatch) -> str:
    """Overrides tests/conftest.py's CPU pin: every rank of this tier runs on CUDA."""
    monkeypatch.setenv(DEVICE_VARIABLE, "cuda")
    return "cuda"

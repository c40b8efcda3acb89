"""Every test outside tests/gpu runs its ranks on the CPU (gloo), even on a GPU node: the tolerances and the
backend the CPU tier asserts are the CPU's. tests/gpu/conftest.py pins its tier to CUDA instead.

When the collected tests import transformers, the fork server their ranks start from (launch/forkserver.py) imports
what the Hugging Face jobs' ranks import (transformers, peft, trl, datasets; pytest, which every test module
imports) once, instead of every rank of every such job importing it again (about 2.5 s of CPU per rank).

Once collected, the test process moves what it holds then (torch, transformers, every test module: about half a
million objects) to the collector's permanent generation (`gc.freeze()`, as the fork server does for its ranks): a
full collection (the profiler's two per block measuring selective recomputation, partition/measure.py; the harness's;
Python's own) then walks only the objects made since, where each walked them all (0.2-0.9 s of CPU)."""

from __future__ import annotations

import gc
import sys

import pytest

from pipetrain.launch.env import DEVICE_VARIABLE
from pipetrain.launch.forkserver import preload_also
from pipetrain.workloads.hf import RANK_IMPORTS

#: What a Hugging Face test job's ranks import beyond the server's own preloads (a module not installed is skipped).
HF_RANK_IMPORTS = ("pytest", *RANK_IMPORTS, "peft", "trl", "datasets")


def pytest_collection_finish(session: pytest.Session) -> None:
    if "transformers" in sys.modules:  # a collected module imports it: so will its jobs' ranks
        preload_also(*HF_RANK_IMPORTS)
    gc.collect()  # nothing unreachable is frozen
    gc.freeze()


@pytest.fixture(autouse=True)
def pinned_device(monkeypatch: pytest.MonkeyPatch) -> str:
    """The device type this tier's ranks run on (PIPETRAIN_DEVICE, inherited by spawned ranks and subprocesses)."""
    monkeypatch.setenv(DEVICE_VARIABLE, "cpu")
    return "cpu"

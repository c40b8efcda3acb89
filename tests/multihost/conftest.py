"""The multihost tier: each test gets a fresh two-host cluster (unique names, removed afterwards, every process
it started killed). The whole tier skips with one line where network namespaces cannot be made."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.netns_cluster import Cluster, environ, losses

_NAMES = itertools.count()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """Two hosts joined by an unshaped link; removed (and every process on them killed) after the test."""
    made = Cluster(name=f"p{os.getpid() % 100000}x{next(_NAMES)}", folder=tmp_path)
    made.up()
    try:
        yield made
    finally:
        made.down()


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """Every step's loss of the elastic test's job (tests/multihost/test_elastic.py `JOB`) in one process (dp=1,
    pp=1), run in this process once for the tests that compare with it (torchrun elastic, the Slurm requeue)."""
    from pipetrain.cli.main import main
    from tests.multihost.test_elastic import JOB, STEPS

    run_dir = tmp_path_factory.mktemp("reference") / "run"
    with pytest.MonkeyPatch.context() as patch:
        for name in set(os.environ) - set(environ()):
            patch.delenv(name)
        for name, value in environ(PIPETRAIN_DEVICE="cpu").items():
            patch.setenv(name, value)
        assert main(["train", *JOB, "--dp", "1", "--pp", "1", "--run-dir", str(run_dir)]) == 0
    steps = losses(run_dir)
    assert sorted(steps) == list(range(1, STEPS + 1)), steps
    return steps

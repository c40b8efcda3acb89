"""The multihost tier: each test gets a fresh two-host cluster (unique names, removed afterwards, every process
it started killed). The whole tier skips with one line where network namespaces cannot be made."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.netns_cluster import Cluster

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

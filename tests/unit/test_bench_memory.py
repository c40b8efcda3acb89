"""Tests of bench memory: the CPU limit makes a big allocation fail catchably, OOM recognition, peaks."""

from __future__ import annotations

import mmap
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipetrain.launch.memory import (
    apply_memory_limit,
    current_memory_mb,
    is_oom_error,
    oom_reason,
    peak_memory_mb,
    reset_peak_memory,
)
from pipetrain.errors import ConfigError

LINUX = sys.platform.startswith("linux")

_CHILD = """
import torch
from pipetrain.launch.memory import apply_memory_limit, is_oom_error, oom_reason
apply_memory_limit(100, torch.device("cpu"))
small = torch.ones(20 * 2**20 // 4)  # 20 MB fits under the 100 MB limit
try:
    big = torch.empty(300 * 2**20 // 4)
except BaseException as exc:
    print("caught", type(exc).__name__, is_oom_error(exc))
    print(oom_reason(exc, "cpu"))
else:
    print("not limited")
again = torch.ones(20 * 2**20 // 4)  # the process is still usable afterwards
print("alive", float(small.sum() + again.sum()))
"""


@pytest.mark.skipif(not LINUX, reason="RLIMIT_DATA limit is Linux only")
def test_cpu_limit_makes_allocation_fail_catchably() -> None:
    src = str(Path(__file__).resolve().parents[2] / "src")
    done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": src, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "caught RuntimeError True"
    assert "bench memory limit" in lines[1] and "DefaultCPUAllocator" in lines[1]
    assert lines[2].startswith("alive")


def test_is_oom_error() -> None:
    assert is_oom_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_oom_error(RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory"))
    assert is_oom_error(MemoryError())
    assert is_oom_error(OSError(12, "Cannot allocate memory"))
    wrapped = RuntimeError("stage 1 failed")
    wrapped.__cause__ = MemoryError()
    assert is_oom_error(wrapped)
    assert not is_oom_error(RuntimeError("shape mismatch"))
    assert not is_oom_error(ValueError("out of range"))


def test_oom_reason_is_one_line() -> None:
    exc = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                       "you tried to allocate 1 bytes.\nmore")
    reason = oom_reason(exc, "cpu")
    assert "\n" not in reason and reason.startswith("out of CPU memory") and "enforce" not in reason
    assert oom_reason(torch.OutOfMemoryError("CUDA out of memory"), "cuda:0").startswith("out of memory on cuda:0")


def test_bad_limits() -> None:
    apply_memory_limit(None, torch.device("cpu"))  # no limit: nothing happens
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ConfigError, match="positive number of MB"):
            apply_memory_limit(bad, torch.device("cpu"))  # type: ignore[arg-type]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_cpu_peak_and_reset() -> None:
    reset = reset_peak_memory("cpu")  # False where the kernel keeps the old peak (CI's sandbox did)
    before = peak_memory_mb("cpu")
    assert reset == (before <= current_memory_mb("cpu") + 8)
    # 64 MB of fresh pages, touched: an anonymous mapping (a tensor could reuse pages the allocator already holds,
    # resident from earlier tests in this process, and leave the peak where it was)
    block = mmap.mmap(-1, 64 * 2**20)
    block.write(b"\x01" * (64 * 2**20))
    peak = peak_memory_mb("cpu")
    assert peak >= current_memory_mb("cpu") - 1 and current_memory_mb("cpu") > 0
    if reset:
        assert peak >= before + 50
    block.close()
    if reset_peak_memory("cpu"):
        assert peak_memory_mb("cpu") < peak - 30

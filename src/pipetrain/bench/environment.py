"""The environment a bench or benchmark ran in: torch, device, CPUs, platform, git revision, date and command line."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import subprocess
from pathlib import Path
from typing import Any

__all__ = ["collect_environment"]


def _git_revision() -> str:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else "unknown"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def collect_environment(command: list[str], *, device: str | None = None) -> dict[str, Any]:
    """Torch version, device (and its name), CPU count, platform, git revision, date and command line."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else _cpu_name()
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "device_name": name,
        "cpu_count": os.cpu_count(),
        "usable_cpus": affinity,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_revision": _git_revision(),
        "command": shlex.join(command),
    }

"""Memory for the bench: a per-process limit (so CPU cells can run "out of memory"), OOM recognition, peaks.

CPU limit. `apply_memory_limit` lowers the soft ``RLIMIT_DATA`` of the calling process to
*baseline + limit_mb*, where baseline is the process's data size (``VmData``) at call time: the limit
counts what the cell allocates after the call (model, optimizer, activations), not the interpreter and
torch, which is the closest analogue of a GPU's memory. Call it in the rank process after importing
torch and before building the model. An allocation past the limit fails with ENOMEM, which torch turns
into ``RuntimeError: ... DefaultCPUAllocator: can't allocate memory ...`` (Python objects: MemoryError);
the process survives and `is_oom_error` recognises both. Thread stacks count too, so under a tight limit
starting a thread fails instead (``RuntimeError: Resource temporarily unavailable`` from C++, e.g. the
TCPStore of the process group; ``can't start new thread`` from Python): while a CPU limit is in force
`is_oom_error` counts those as out of memory as well. Measured on Linux 6.18 / torch 2.13:
``RLIMIT_AS`` fails the same way, but it counts address space that is only reserved: each new thread's
malloc arena reserves 64 MB (8 threads: +577 MB VmSize versus +65 MB VmData), so the budget would
depend on the thread count. ``RLIMIT_DATA`` counts private writable mappings (heap, anonymous mmap,
thread stacks of 8 MB each; a gloo process group costs ~32 MB) whether touched or not: a
``torch.empty`` counts in full.

CPU peak. `peak_memory_mb` reads ``VmHWM`` from /proc/self/status: the peak resident set size of the
whole process (interpreter and torch's ~250 MB included, shared-library pages that are resident
included), in MB (2**20 bytes). `reset_peak_memory` writes "5" to /proc/self/clear_refs, which resets
VmHWM to the current RSS (verified here). Without /proc, the figure is ``ru_maxrss`` (never reset).

CUDA. The limit is ``torch.cuda.set_per_process_memory_fraction(limit / total)``: an absolute cap on
the caching allocator, which does not count the CUDA context; the peak is ``max_memory_allocated``.
"""

from __future__ import annotations

import errno
import resource
import sys
from pathlib import Path

import torch

from pipetrain.errors import ConfigError

__all__ = [
    "apply_memory_limit",
    "lift_memory_limit",
    "is_oom_error",
    "oom_reason",
    "peak_memory_mb",
    "peak_reserved_mb",
    "device_baseline_bytes",
    "current_memory_mb",
    "reset_peak_memory",
]

_MB = 1024 * 1024
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_OOM_MESSAGES = ("DefaultCPUAllocator: can't allocate memory", "CUDA out of memory", "out of memory")
_THREAD_MESSAGES = ("Resource temporarily unavailable", "can't start new thread")


def _device(device: torch.device | str) -> torch.device:
    return device if isinstance(device, torch.device) else torch.device(device)


def _proc_status_mb(field: str) -> float | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def apply_memory_limit(limit_mb: int | None, device: torch.device | str) -> None:
    """Cap the memory this process may use for `device` at `limit_mb` MB (None: no limit; see module doc)."""
    if limit_mb is None:
        return
    if isinstance(limit_mb, bool) or not isinstance(limit_mb, int) or limit_mb < 1:
        raise ConfigError(f"memory limit must be a positive number of MB, got {limit_mb!r}", hint="e.g. --mem 2048")
    dev = _device(device)
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).total_memory
        if limit_mb * _MB > total:
            raise ConfigError(
                f"memory limit {limit_mb} MB is more than the {total // _MB} MB of {dev}",
                hint=f"pass a limit of at most {total // _MB} MB, or none",
            )
        torch.cuda.set_per_process_memory_fraction(limit_mb * _MB / total, index)
        return
    if dev.type != "cpu":
        raise ConfigError(f"cannot limit memory on device type {dev.type!r}", hint="use cpu or cuda, or no limit")
    if not sys.platform.startswith("linux"):
        raise ConfigError("the CPU memory limit needs Linux (RLIMIT_DATA)", hint="run without a memory limit")
    baseline = _proc_status_mb("VmData")
    if baseline is None:
        raise ConfigError("cannot read VmData from /proc/self/status", hint="run without a memory limit")
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    wanted = int((baseline + limit_mb) * _MB)
    if hard != resource.RLIM_INFINITY and wanted > hard:
        raise ConfigError(
            f"memory limit {limit_mb} MB + baseline {baseline:.0f} MB exceeds the hard RLIMIT_DATA "
            f"({hard // _MB} MB)",
            hint="pass a smaller limit or raise `ulimit -d`",
        )
    resource.setrlimit(resource.RLIMIT_DATA, (wanted, hard))


def lift_memory_limit(device: torch.device | str) -> None:
    """Undo `apply_memory_limit` (CPU: soft limit raised to the hard one), so a failed rank can still report."""
    dev = _device(device)
    if dev.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(1.0, dev.index if dev.index is not None else None)
    elif dev.type == "cpu" and sys.platform.startswith("linux"):
        _, hard = resource.getrlimit(resource.RLIMIT_DATA)
        resource.setrlimit(resource.RLIMIT_DATA, (hard, hard))


def _cpu_limited() -> bool:
    return sys.platform.startswith("linux") and resource.getrlimit(resource.RLIMIT_DATA)[0] != resource.RLIM_INFINITY


def _oom_in_chain(exc: BaseException) -> BaseException | None:
    """The first exception of `exc`'s chain (itself, then what it was raised from) that is out of memory."""
    seen: set[int] = set()
    current: BaseException | None = exc
    messages = _OOM_MESSAGES + (_THREAD_MESSAGES if _cpu_limited() else ())
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (torch.OutOfMemoryError, MemoryError)):
            return current
        if isinstance(current, RuntimeError) and any(m in str(current) for m in messages):
            return current
        if isinstance(current, OSError) and current.errno == errno.ENOMEM:
            return current
        current = current.__cause__ or current.__context__
    return None


def is_oom_error(exc: BaseException) -> bool:
    """True if `exc` (or an exception it was raised from) is an out-of-memory failure on CPU or CUDA.

    Under a CPU limit (RLIMIT_DATA), a thread that cannot start (no room for its stack) counts as well.
    """
    return _oom_in_chain(exc) is not None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def oom_reason(exc: BaseException, device: torch.device | str) -> str:
    """A one-line reason for a cell result: what ran out, and the limit in force if one was set.

    The message is that of the out-of-memory exception in `exc`'s chain (a pipeline stage wraps it in
    "[Stage 0] failed to run forward"), followed by the wrapper's first line when there is one.
    """
    dev = _device(device)
    cause = _oom_in_chain(exc) or exc
    first = _first_line(cause)
    if "DefaultCPUAllocator" in first:
        first = first[first.index("DefaultCPUAllocator"):]
    elif any(m in first for m in _THREAD_MESSAGES):
        first = f"no room for a new thread's stack ({first})"
    if cause is not exc:
        first += f" (in: {_first_line(exc).rstrip(':')})"
    if dev.type == "cpu":
        soft, _ = resource.getrlimit(resource.RLIMIT_DATA)
        if soft != resource.RLIM_INFINITY:
            return (f"out of CPU memory: the bench memory limit (RLIMIT_DATA = {soft // _MB} MB, "
                    f"process baseline at start included) was exceeded: {first}")
        return f"out of CPU memory: {first}"
    return f"out of memory on {dev}: {first}"


_RESET_SLACK_MB = 8.0  # the resident set may grow between the reset and the read


def peak_memory_mb(device: torch.device | str) -> float:
    """Peak since the last reset, MB: CUDA max allocated by tensors; CPU peak RSS of the process (VmHWM)."""
    dev = _device(device)
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated(dev) / _MB
    hwm = _proc_status_mb("VmHWM")
    if hwm is not None:
        return hwm
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss / _MB if sys.platform == "darwin" else maxrss / 1024  # bytes on macOS, KiB on Linux


def peak_reserved_mb(device: torch.device | str) -> float | None:
    """CUDA: the caching allocator's peak reservation since the last reset, MB (what the device gave it: at least the
    peak allocated, plus the allocator's reserve); None on the CPU, whose peak RSS already is what the OS gave."""
    dev = _device(device)
    return torch.cuda.max_memory_reserved(dev) / _MB if dev.type == "cuda" else None


def device_baseline_bytes(device: torch.device | str) -> float:
    """Memory a rank holds on its device before any model, bytes. CUDA: what the device has in use
    (`mem_get_info`) less the caching allocator's reservation: the CUDA context, NCCL's buffers (measure after
    the first collective) and any other process on the GPU; CPU: the resident set size."""
    dev = _device(device)
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        return float(max(total - free - torch.cuda.memory_reserved(dev), 0))
    return current_memory_mb(dev) * _MB


def current_memory_mb(device: torch.device | str) -> float:
    """Memory in use now, MB: CUDA allocated by tensors; CPU resident set size (VmRSS), 0 if unknown."""
    dev = _device(device)
    if dev.type == "cuda":
        return torch.cuda.memory_allocated(dev) / _MB
    return _proc_status_mb("VmRSS") or 0.0


def reset_peak_memory(device: torch.device | str) -> bool:
    """Restart the peak measurement; False when the platform cannot: a CPU without /proc/self/clear_refs, or one
    whose kernel takes the write and keeps the old peak (some sandboxes: the peak stays above the resident set)."""
    dev = _device(device)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        return True
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    peak, now = _proc_status_mb("VmHWM"), _proc_status_mb("VmRSS")
    return peak is not None and now is not None and peak <= now + _RESET_SLACK_MB

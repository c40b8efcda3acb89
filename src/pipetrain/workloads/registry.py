"""The workload registry: name -> `Workload` (model presets, data streams, loss and metrics) for the trainer.

The trainer knows no workload by name: it asks `get_workload(config.workload)` for a `BlockModel`, the
train/evaluation datasets, their batches, the loss the engine minimises and which metrics to report. Built-in
workloads are imported only when asked for (so an optional one, e.g. needing `transformers`, costs
nothing until used); `register` adds one under a new name, and an import path (`MODULE:NAME`,
`path/to/file.py:NAME`, see `loader`) names a workload defined anywhere.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from pipetrain.errors import ConfigError
from pipetrain.workloads.base import Batch, DataRequest, Dataset, Workload
from pipetrain.workloads.loader import load_workload
from pipetrain.workloads.names import BUILTIN, is_import_spec, unknown_workload

__all__ = ["Batch", "Dataset", "DataRequest", "Workload", "register", "get_workload", "workload_names"]

_REGISTERED: dict[str, Callable[[], Workload]] = {}


def register(name: str, factory: Callable[[], Workload]) -> None:
    """Make `get_workload(name)` return `factory()`; a name already taken raises ConfigError."""
    if name in BUILTIN or name in _REGISTERED:
        raise ConfigError(f"workload {name!r} is already registered", hint="register it under another name")
    _REGISTERED[name] = factory


def workload_names() -> tuple[str, ...]:
    """Every name `get_workload` accepts, built-in first."""
    return (*BUILTIN, *_REGISTERED)


def get_workload(name: str) -> Workload:
    """The workload registered as `name`, or named by the import path `MODULE:NAME` / `file.py:NAME`; an unknown
    name raises ConfigError listing the known ones."""
    if name in _REGISTERED:
        return _REGISTERED[name]()
    if name not in BUILTIN:
        if is_import_spec(name):
            return load_workload(name)
        raise unknown_workload(name, workload_names())
    module, _, cls = BUILTIN[name].partition(":")
    return getattr(importlib.import_module(module), cls)()

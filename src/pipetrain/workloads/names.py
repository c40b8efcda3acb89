"""The names of the built-in workloads and the one-line error of an unknown one, without importing torch: the
command line says a misspelt `--workload` before its heavy imports (cli/main.py)."""

from __future__ import annotations

from collections.abc import Iterable

from pipetrain.errors import ConfigError

__all__ = ["BUILTIN", "is_import_spec", "unknown_workload"]

#: Built-in workloads, imported on first use: name -> "module:class".
BUILTIN: dict[str, str] = {
    "classifier": "pipetrain.workloads.classifier.workload:ClassifierWorkload",
    "lm": "pipetrain.workloads.lm.workload:LanguageModelWorkload",
    "hf": "pipetrain.workloads.hf.workload:HFWorkload",
    "vision": "pipetrain.workloads.vision.workload:VisionWorkload",
}


def is_import_spec(spec: str) -> bool:
    """Whether `spec` names a workload by import path (`MODULE:NAME` or `file.py:NAME`) rather than by name."""
    return ":" in spec


def unknown_workload(name: str, known: Iterable[str]) -> ConfigError:
    """The error of the workload `name`, none of the `known` names nor an import path."""
    return ConfigError(f"unknown workload {name!r}",
                       hint=f"choose one of: {', '.join(known)}, or name your own as MODULE:NAME or "
                            "path/to/file.py:NAME")

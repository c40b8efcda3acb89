"""Import paths that moved (0.2's new rooms): each still imports, as the module it became, with a DeprecationWarning.

`install()` (run by `import pipetrain`) puts one finder at the end of `sys.meta_path`; it answers only the old
names below, so nothing else is slowed. `python -m OLD` runs the new module too. `pipetrain.workloads.classifier`
became a package: its `__init__` answers the old module's names itself.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType

__all__ = ["MOVED", "install"]

#: old import path -> the module it moved to
MOVED: dict[str, str] = {
    "pipetrain.workloads.transformer_tp": "pipetrain.workloads.classifier.tp",
    "pipetrain.workloads.transformer": "pipetrain.workloads.classifier.model",
    "pipetrain.workloads.presets": "pipetrain.workloads.classifier.presets",
    "pipetrain.workloads.imdb_package": "pipetrain.workloads.classifier.imdb_package",
    "pipetrain.workloads.imdb": "pipetrain.workloads.classifier.imdb",
    "pipetrain.workloads.language_model": "pipetrain.workloads.lm.workload",
    "pipetrain.workloads.gpt_tp": "pipetrain.workloads.lm.tp",
    "pipetrain.workloads.gpt": "pipetrain.workloads.lm.gpt",
    "pipetrain.workloads.corpus": "pipetrain.workloads.lm.corpus",
    "pipetrain.workloads.gutenberg": "pipetrain.workloads.text.gutenberg",
    "pipetrain.workloads.buckets": "pipetrain.workloads.text.batching",
    "pipetrain.workloads.hf_workload": "pipetrain.workloads.hf.workload",
    "pipetrain.workloads.hf_causal_lm": "pipetrain.workloads.hf.causal_lm",
    "pipetrain.workloads.hf_tp": "pipetrain.workloads.hf.tp",
    "pipetrain.workloads.hf_text": "pipetrain.workloads.hf.text",
    "pipetrain.workloads.smollm2": "pipetrain.workloads.hf.smollm2",
    "pipetrain.checkpoint.hf_export": "pipetrain.workloads.hf.export",
    "pipetrain.bench.memory": "pipetrain.launch.memory",
    "pipetrain.cli.device_flags": "pipetrain.cli.device_args",
    "pipetrain.cli.log_flags": "pipetrain.cli.log_args",
    "pipetrain.pipeline.plan": "pipetrain.pipeline.runs",
    "pipetrain.pipeline.compat": "pipetrain.compat.pipelining",
    "pipetrain.trainer": "pipetrain.train.loop",
    "pipetrain.parallel.tensor_styles": "pipetrain.compat.tensor_styles",
    "pipetrain.trace.report": "pipetrain.trace.files",
    "pipetrain.check.report": "pipetrain.check.findings",
}


def _warn(old: str) -> None:
    warnings.warn(f"{old} moved to {MOVED[old]}: import it from there (the old path will be removed)",
                  DeprecationWarning, stacklevel=4)


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and loads it as the module it moved to (the same module object)."""

    def find_spec(self, name: str, path: object = None, target: object = None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec) -> ModuleType:
        _warn(spec.name)
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        """Nothing: the new module ran when it was imported."""

    def get_code(self, name: str):  # `python -m OLD`
        _warn(name)
        new = importlib.util.find_spec(MOVED[name])
        return new.loader.get_code(MOVED[name])


def install() -> None:
    """Make the old paths of `MOVED` importable (once per interpreter)."""
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.append(_Alias())

"""The reference workload: a Transformer-encoder classifier of IMDB reviews (model, TP plan, presets, readers).

This was the module `pipetrain.workloads.classifier` before 0.2: its names still import from here, with a
DeprecationWarning pointing at `pipetrain.workloads.classifier.workload`.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

_OLD_NAMES = ("ClassifierWorkload", "bucketed_reviews", "REAL_EPOCHS")


def __getattr__(name: str) -> Any:
    if name not in _OLD_NAMES:
        raise AttributeError(f"module 'pipetrain.workloads.classifier' has no attribute {name!r}")
    warnings.warn(f"pipetrain.workloads.classifier.{name} moved to pipetrain.workloads.classifier.workload",
                  DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module("pipetrain.workloads.classifier.workload"), name)

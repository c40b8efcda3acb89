"""`FolderObjective`: the base of the objectives' workloads, a model folder's `hf` workload with another loss and data.

The model, its window, presets and the job's and recipe's defaults are the wrapped `hf` workload's; a subclass reads
its own rows (`load_data`) and gives its own loss and batches.
"""

from __future__ import annotations

from typing import Any

from pipetrain.errors import ConfigError
from pipetrain.workloads.hf.workload import HFWorkload
from pipetrain.workloads.registry import Workload

__all__ = ["FolderObjective"]


class FolderObjective(Workload):
    """A model folder's `hf` workload (`inner`) trained on an objective of its own (`settings`)."""

    #: what the objective needs of the command line when no model folder is given (the message's hint)
    needs_folder: tuple[str, str] = ("this objective trains a pretrained model folder", "pass --workload hf --model DIR")

    def __init__(self, inner: HFWorkload, settings: Any) -> None:
        if inner.folder is None:
            raise ConfigError(self.needs_folder[0], hint=self.needs_folder[1])
        self.inner, self.settings = inner, settings
        self.name, self.summary, self.presets = inner.name, inner.summary, inner.presets

    def check_preset(self, preset: str) -> None:
        self.inner.check_preset(preset)

    def model(self, preset: str, *, seq_len: int | None = None) -> Any:
        return self.inner.model(preset, seq_len=seq_len)

    def window(self, preset: str, *, seq_len: int | None, synthetic: bool) -> int | None:
        return self.inner.window(preset, seq_len=seq_len, synthetic=synthetic)

    def job_defaults(self, *, synthetic: bool) -> dict[str, Any]:
        return self.inner.job_defaults(synthetic=synthetic)

    def recipe_defaults(self, *, synthetic: bool, max_steps: int | None = None) -> dict[str, Any]:
        return self.inner.recipe_defaults(synthetic=synthetic, max_steps=max_steps)

"""LoRA through PEFT on each rank's own blocks: the settings (`LoraSettings`), the block model that injects PEFT's
layers and freezes the base (`LoraBlocks`), the tensor-parallel split of the adapters (`lora_tp_plan`), the base
folder's identity a LoRA checkpoint records (`base_identity`), and the export of an adapter checkpoint as a PEFT
folder or a merged transformers folder (`export_peft`, `export_merged`); `adapters_disabled`: the base alone for a
while. See docs/lora.md."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipetrain.lazy import lazy_exports

#: public name -> the module that defines it (loaded on first use: `LoraSettings` needs no torch)
_EXPORTS = {
    **dict.fromkeys(("LoraSettings", "require_peft"), "pipetrain.lora.config"),
    **dict.fromkeys(("LoraBlocks", "is_adapter"), "pipetrain.lora.model"),
    "adapters_disabled": "pipetrain.lora.switch",
    "lora_tp_plan": "pipetrain.lora.tp",
}

__all__ = ["LoraSettings", "LoraBlocks", "require_peft", "lora_tp_plan", "is_adapter", "adapters_disabled"]

if TYPE_CHECKING:
    from pipetrain.lora.config import LoraSettings, require_peft
    from pipetrain.lora.model import LoraBlocks, is_adapter
    from pipetrain.lora.switch import adapters_disabled
    from pipetrain.lora.tp import lora_tp_plan

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

"""`LoraBlocks`: a `BlockModel` whose blocks carry PEFT's LoRA layers, the base frozen.

Each rank builds its own blocks as the wrapped model builds them (base weights loaded from the model's folder),
then PEFT injects its LoRA layers into the block (`peft.inject_adapter_in_model` with a `LoraConfig` naming the
targets found in that block) and every parameter outside them stops requiring a gradient. This happens in
`build_block`, so before tensor parallelism splits a block and before DDP / FSDP2 wrap a stage: the frozen base gets
no gradient, no optimizer state and no reduction. The targets default to the model's attention and MLP projections
(`lora_targets()`, read by `HFCausalLM` from its family description); a model without that hook is refused, as are
targets that name no module. The block seed (`build_blocks`) also seeds PEFT's initialisation of A, so every rank
(and every replica) builds the same adapters.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pipetrain.blocks import BlockModel, Tensors, tp_ability, tp_plan_hook
from pipetrain.errors import ConfigError
from pipetrain.lora.config import ADAPTER_NAME, LoraSettings, is_parameter_target, require_peft
from pipetrain.lora.identity import WHOLE, config_identity, folder_identity
from pipetrain.lora.tp import lora_tp_plan
from pipetrain.parallel.tensor import TPPlan

__all__ = ["LoraBlocks", "is_adapter", "ADAPTER_NAME"]


def is_adapter(name: str) -> bool:
    """Whether parameter `name` belongs to a LoRA adapter (PEFT's `lora_A` / `lora_B`)."""
    return ".lora_A." in name or ".lora_B." in name


def _projections(block: nn.Module) -> list[str]:
    """What --lora-targets can name in `block`: the leaf names of its linear layers, and `module.parameter` for
    the weights PEFT adapts as parameters (2-D and 3-D ones outside linear layers: a MoE router's weight, fused
    experts)."""
    found = []
    for name, module in block.named_modules():
        leaf = name.rpartition(".")[2]
        if isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D":
            if leaf and leaf not in found:
                found.append(leaf)
            continue
        for pname, param in module.named_parameters(recurse=False):
            target = f"{leaf}.{pname}"
            if leaf and param.dim() in (2, 3) and target not in found and not isinstance(module, nn.Embedding):
                found.append(target)
    return found


def _matches(name: str, targets: tuple[str, ...]) -> bool:
    return any(name == t or name.endswith(f".{t}") for t in targets)


def _present(block: nn.Module, target: str) -> bool:
    """Whether `target` (a module's leaf name, or `module.parameter`) names something in `block`."""
    names = block.named_parameters() if is_parameter_target(target) else block.named_modules()
    return any(_matches(name, (target,)) for name, _ in names)


class LoraBlocks:
    """`model`'s blocks with LoRA adapters on the modules named by `settings` (see the module's docstring)."""

    def __init__(self, model: BlockModel, settings: LoraSettings, *, workload: str = "") -> None:
        require_peft()
        hook = getattr(model, "lora_targets", None)
        if hook is None:
            named = f"workload {workload!r}" if workload else f"the model {type(model).__name__}"
            raise ConfigError(f"--lora-rank {settings.rank}: {named} has no family description naming its "
                              "projections, so LoRA does not know where to go",
                              hint="use --workload hf (a Hugging Face causal LM: --model DIR or an hf preset), or "
                                   "drop --lora-rank to train every parameter")
        self.inner, self.settings = model, settings
        self.targets: tuple[str, ...] = settings.targets or tuple(hook())
        self._identity: dict[str, dict[str, Any]] = {}  # by hashing method
        self._check_targets()

    def _check_targets(self) -> None:
        """One ConfigError naming the targets that match no module of any block, and the projections found."""
        found: list[str] = []
        for index in range(self.inner.num_blocks):
            with torch.device("meta"):
                block = self.inner.build_block(index)
            found += [leaf for leaf in _projections(block) if leaf not in found]
        missing = [t for t in self.targets if not any(leaf == t or leaf.endswith(f".{t}") for leaf in found)]
        if missing:
            raise ConfigError(f"--lora-targets {','.join(self.targets)}: {', '.join(repr(m) for m in missing)} "
                              f"names no module or parameter of the model",
                              hint=f"name some of its projections or parameters: {','.join(found)}")

    # ---- BlockModel ----------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.inner.num_blocks

    def example_input(self, batch_size: int) -> Tensors:
        return self.inner.example_input(batch_size)

    def build_block(self, index: int) -> nn.Module:
        """Block `index` of the wrapped model, with PEFT's LoRA layers on its targets, everything else frozen."""
        block = self.inner.build_block(index)
        targets = tuple(t for t in self.targets if _present(block, t))
        if targets:
            peft = require_peft()
            block = peft.inject_adapter_in_model(self.settings.peft_config(targets), block, ADAPTER_NAME)
        for name, param in block.named_parameters():
            param.requires_grad_(is_adapter(name))
        return block

    def adapted_modules(self, index: int) -> list[str]:
        """The names (in block `index`) of the modules that carry an adapter."""
        with torch.device("meta"):
            block = self.build_block(index)
        return [name for name, module in block.named_modules() if hasattr(module, "lora_A") and
                ADAPTER_NAME in getattr(module, "lora_A", {})]

    def base_identity(self, method: str = WHOLE) -> dict[str, Any]:
        """The base model's folder and a digest of its config and weights (`pipetrain.lora.identity`; `method`: how
        the files are hashed, EDGES only to compare with an older checkpoint), recorded in a checkpoint of the
        adapters and compared on resume and export; computed once per method."""
        if method not in self._identity:
            source = getattr(self.inner, "checkpoint", None)
            folder = getattr(source, "folder", None)
            if folder is not None:
                self._identity[method] = folder_identity(folder, method)
            else:
                config = getattr(self.inner, "config", None)
                text = config.to_json_string() if hasattr(config, "to_json_string") else repr(config)
                self._identity[method] = config_identity(text)
        return self._identity[method]

    def tied_parameters(self) -> list:
        hook = getattr(self.inner, "tied_parameters", None)
        return hook() if hook is not None else []

    @tp_plan_hook(loss_parallel=True)
    def tp_plan(self, index: int, tp: int, *, sequence_parallel: bool = False, loss_parallel: bool = False) -> TPPlan:
        """The wrapped model's plan for block `index`, each adapted projection's style moved to its base layer and
        its adapter split to follow (`lora_tp_plan`); `loss_parallel`: the wrapped model's vocabulary-parallel
        embedding and head, refused when an adapter sits on either."""
        ability = tp_ability(self.inner)
        if ability is None:
            raise ConfigError(f"the model {type(self.inner).__name__} has no tensor-parallel plan, so --tp {tp} "
                              "cannot split it", hint="run it with --tp 1")
        if loss_parallel and not ability.loss_parallel:
            raise ConfigError(f"the model {type(self.inner).__name__} has no vocabulary-parallel head for "
                              "--loss-parallel", hint="drop --loss-parallel")
        extra = {"loss_parallel": True} if loss_parallel else {}
        plan = self.inner.tp_plan(index, tp, sequence_parallel=sequence_parallel, **extra)
        adapted = self.adapted_modules(index) if plan is not None else []
        if loss_parallel and index in (0, self.num_blocks - 1) and set(plan or {}) & set(adapted):
            raise ConfigError(f"--loss-parallel splits {', '.join(sorted(set(plan or {}) & set(adapted)))} over the "
                              "vocabulary, but LoRA adapts it", hint="drop --loss-parallel, or leave it out of "
                                                                      "--lora-targets")
        return None if plan is None else lora_tp_plan(plan, adapted)

    def parameter_keys(self, index: int) -> dict[str, str]:
        """Block `index`'s parameter names -> their names in the transformers model with PEFT's layers
        (`...q_proj.base_layer.weight`, `...q_proj.lora_A.default.weight`)."""
        with torch.device("meta"):
            block = self.build_block(index)
        return dict(block.checkpoint_keys())

    def __getattr__(self, name: str) -> Any:  # config, family, seq_len, tied, attention_shape...
        if name in ("inner", "settings", "targets", "_identity"):
            raise AttributeError(name)
        return getattr(self.inner, name)

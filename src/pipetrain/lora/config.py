"""`LoraSettings`: a LoRA fine-tune's rank, alpha, dropout and target modules, checked on construction, as PEFT's
own `LoraConfig`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipetrain.errors import ConfigError

__all__ = ["LoraSettings", "require_peft", "ADAPTER_NAME", "is_parameter_target"]

#: the name PEFT gives the one adapter (`lora_A.default`); a PEFT adapter folder's keys drop it
ADAPTER_NAME = "default"


def require_peft() -> Any:
    """The `peft` module, or a ConfigError saying how to install it."""
    try:
        import peft
    except ImportError:
        raise ConfigError("LoRA adapters need the 'peft' package", hint="pip install 'pipetrain[lora]'") from None
    return peft


def is_parameter_target(target: str) -> bool:
    """Whether a `--lora-targets` name names a parameter (`gate.weight`, `experts.gate_up_proj`: a module's leaf
    name and the parameter's, PEFT's `target_parameters`) rather than a module (`q_proj`, PEFT's `target_modules`)."""
    return "." in target


@dataclass(frozen=True, kw_only=True)
class LoraSettings:
    """`--lora-rank R --lora-alpha A --lora-dropout P --lora-targets a,b`: the adapters' rank, their scale
    (`alpha / rank`; None: 2 * rank), the dropout before them, and the leaf names of the modules that get one
    (empty: the model's own attention and MLP projections, its family description's `lora_targets`); a target
    `module.parameter` (`gate.weight`, `experts.gate_up_proj`) adapts that parameter itself, as PEFT's
    `target_parameters` does: a MoE router's weight, or a layer's fused experts (one adapter per expert).
    `init` is PEFT's `init_lora_weights` (True: B starts at zero, the adapted model starts as the base)."""

    rank: int
    alpha: float | None = None
    dropout: float = 0.0
    targets: tuple[str, ...] = ()
    init: bool | str = True

    def __post_init__(self) -> None:
        if isinstance(self.targets, str):
            object.__setattr__(self, "targets", tuple(t.strip() for t in self.targets.split(",") if t.strip()))
        else:
            object.__setattr__(self, "targets", tuple(self.targets))
        if self.rank < 1:
            raise ConfigError(f"--lora-rank must be 1 or more, got {self.rank}", hint="pass --lora-rank 8, for example")
        if self.alpha is not None and self.alpha <= 0:
            raise ConfigError(f"--lora-alpha must be positive, got {self.alpha}",
                              hint=f"pass --lora-alpha {2 * self.rank} (twice the rank), or drop it")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"--lora-dropout must be in [0, 1), got {self.dropout}", hint="pass --lora-dropout 0.05")

    @property
    def scale_alpha(self) -> float:
        """alpha (2 * rank when not given)."""
        return float(2 * self.rank if self.alpha is None else self.alpha)

    def peft_config(self, targets: tuple[str, ...]) -> Any:
        """PEFT's `LoraConfig` of these settings over `targets`: module names, and parameter names
        (`is_parameter_target`) as its `target_parameters`."""
        alpha = self.scale_alpha
        modules = [t for t in targets if not is_parameter_target(t)]
        parameters = [t for t in targets if is_parameter_target(t)]
        return require_peft().LoraConfig(r=self.rank, lora_alpha=int(alpha) if alpha.is_integer() else alpha,
                                         lora_dropout=self.dropout, target_modules=modules,
                                         target_parameters=parameters or None, init_lora_weights=self.init,
                                         bias="none")

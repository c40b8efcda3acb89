"""The GPT-style decoder's sizes (`GPTConfig`) and its named presets: plain data."""

from __future__ import annotations

from dataclasses import dataclass

from pipetrain.errors import ConfigError

__all__ = ["GPTConfig", "GPT_PRESETS"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Sizes of `GPTModel`; `emsize` must be a multiple of `nhead`; `seq_len` is the longest input.

    `causal_flag` (default): attention runs with `is_causal=True` and no mask tensor, which lets CUDA pick
    FlashAttention. It is exact for right-padded batches (each sample's tokens first, padding after: the corpus's
    layout): a token's earlier keys are then never padding, and only padding positions, which the loss skips,
    attend differently. False: the explicit mask of earlier non-padding keys, for padding anywhere.
    """

    vocab_size: int
    seq_len: int
    emsize: int
    nhead: int
    nlayers: int
    dropout: float = 0.0
    mlp_ratio: int = 4
    causal_flag: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "emsize", "nhead", "nlayers", "mlp_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"GPT {name} must be a positive integer, got {value!r}", hint=f"pass {name} >= 1")
        if self.emsize % self.nhead:
            raise ConfigError(f"GPT emsize={self.emsize} is not divisible by nhead={self.nhead}",
                              hint="choose nhead among the divisors of emsize")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"GPT dropout must be in [0, 1), got {self.dropout!r}", hint="pass e.g. dropout=0.1")

    @property
    def num_blocks(self) -> int:
        return self.nlayers + 2


#: `tiny` is for tests (a step takes milliseconds); `cpu` trains visibly in minutes on a 2-core machine.
GPT_PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=96, seq_len=32, emsize=32, nhead=2, nlayers=4),
    "cpu": GPTConfig(vocab_size=1024, seq_len=128, emsize=64, nhead=4, nlayers=4, dropout=0.1),
}

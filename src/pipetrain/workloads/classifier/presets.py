"""The reference Transformer's sizes and named presets: plain data, no torch (the planner reads them)."""

from __future__ import annotations

from dataclasses import dataclass

from pipetrain.errors import ConfigError

__all__ = ["TransformerConfig", "PRESETS", "REAL_EPOCHS"]

#: Epochs of a job on real reviews that does not say (--epochs).
REAL_EPOCHS = 1


def _positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"transformer {name} must be a positive integer, got {value!r}", hint=f"pass {name} >= 1")


@dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    """Sizes of `TransformerClassifier`; `emsize` must be a multiple of `nhead`.

    `seq_len` is the window the planner, the benchmarks and the synthetic corpus use; `review_len`, when set, is
    the window for real reviews (reviews are longer than what a benchmark needs); None means `seq_len`.
    """

    vocab_size: int
    seq_len: int
    emsize: int
    nhead: int
    nhid: int
    nlayers: int
    dropout: float
    num_classes: int = 2
    review_len: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "emsize", "nhead", "nhid", "nlayers", "num_classes"):
            _positive_int(name, getattr(self, name))
        if self.review_len is not None:
            _positive_int("review_len", self.review_len)
        if self.vocab_size < 2:
            raise ConfigError(
                f"transformer vocab_size must be at least 2 (padding and unknown ids), got {self.vocab_size}",
                hint="pass vocab_size >= 2",
            )
        if self.num_classes < 2:
            raise ConfigError(
                f"transformer num_classes must be at least 2, got {self.num_classes}",
                hint="pass num_classes >= 2",
            )
        if self.emsize % self.nhead:
            raise ConfigError(
                f"transformer emsize={self.emsize} is not divisible by nhead={self.nhead}",
                hint="choose nhead among the divisors of emsize",
            )
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not (
            0.0 <= self.dropout < 1.0
        ):
            raise ConfigError(
                f"transformer dropout must be in [0, 1), got {self.dropout!r}", hint="pass e.g. dropout=0.1"
            )

    def window(self, *, real: bool) -> int:
        """Tokens per review: `review_len` (when set) for real reviews, else `seq_len`."""
        return self.review_len if real and self.review_len is not None else self.seq_len

    @property
    def num_blocks(self) -> int:
        """Embedding block + encoder layers + head block."""
        return self.nlayers + 2


#: Named sizes. `tiny` is for tests. `cpu` makes one batch-64 forward+backward take a few tenths of a
#: second on one CPU core (~0.4 s on the 2-core development machine). `gpu` takes emsize, nhid, nhead,
#: nlayers and dropout from the PyTorch pipeline-parallelism tutorial (Transformer + Pipe) that the IDRIS
#: benchmark derives from; its seq_len (256) and vocab_size (30000, close to the tutorial's WikiText-2
#: vocabulary) are chosen for IMDB reviews (the tutorial used 35-token windows).
PRESETS: dict[str, TransformerConfig] = {
    "tiny": TransformerConfig(
        vocab_size=1000, seq_len=32, emsize=32, nhead=2, nhid=64, nlayers=4, dropout=0.0
    ),
    "cpu": TransformerConfig(
        vocab_size=20000, seq_len=64, emsize=64, nhead=2, nhid=128, nlayers=8, dropout=0.1, review_len=160
    ),
    "gpu": TransformerConfig(
        vocab_size=30000, seq_len=256, emsize=4096, nhead=16, nhid=4096, nlayers=12, dropout=0.2
    ),
}

"""Words of text as token ids: lower-case word tokens and a vocabulary of the most frequent ones.

One convention everywhere: id 0 is padding, id 1 is "unknown", the other ids are words, most frequent first.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from pipetrain.errors import ConfigError, DataError

__all__ = ["PAD_ID", "UNK_ID", "Vocabulary", "tokenize", "positive"]

PAD_ID = 0
UNK_ID = 1

_BREAK = re.compile(r"<br\s*/?>", re.IGNORECASE)
_WORD = re.compile(r"[a-z0-9']+")


def positive(name: str, value: int) -> None:
    """Raise ConfigError unless `value` is a positive int."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}", hint=f"pass {name} >= 1")


def tokenize(text: str) -> list[str]:
    """Lower-case words of `text` (`[a-z0-9']+`), with HTML line breaks (`<br />`) removed."""
    return _WORD.findall(_BREAK.sub(" ", text.lower()))


@dataclass(frozen=True)
class Vocabulary:
    """Word <-> id mapping; `words[i]` is the word of id `i`, ids 0 and 1 are padding and unknown."""

    words: tuple[str, ...]
    _index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.words[:2] != ("<pad>", "<unk>"):
            raise DataError("a vocabulary must start with '<pad>', '<unk>'", hint="build it with Vocabulary.build")
        object.__setattr__(self, "_index", {word: i for i, word in enumerate(self.words)})

    @classmethod
    def build(cls, texts: Iterable[str], *, max_size: int, min_freq: int = 1) -> Vocabulary:
        """The `max_size - 2` most frequent words seen at least `min_freq` times (ties: alphabetical)."""
        positive("min_freq", min_freq)
        if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 2:
            raise ConfigError(f"vocabulary size must be at least 2, got {max_size!r}", hint="pass vocab_size >= 2")
        counts = Counter(word for text in texts for word in tokenize(text))
        ranked = sorted((w for w, c in counts.items() if c >= min_freq), key=lambda w: (-counts[w], w))
        return cls(("<pad>", "<unk>", *ranked[: max_size - 2]))

    def __len__(self) -> int:
        return len(self.words)

    def id_of(self, word: str) -> int:
        return self._index.get(word, UNK_ID)

    def encode(self, text: str, seq_len: int) -> list[int]:
        """`seq_len` ids of `text`: its first words, padded with `PAD_ID` at the end."""
        ids = [self.id_of(word) for word in tokenize(text)[:seq_len]]
        return ids + [PAD_ID] * (seq_len - len(ids))

"""Answer accuracy, pure: a generated answer matches its reference when both are equal after normalisation
(lowercase, punctuation removed, whitespace collapsed and stripped), the usual exact-match rule of QA benchmarks.
Also where a row's prompt and reference answer are among its tokens (the untrained prefix, the first trained run)."""

from __future__ import annotations

import string
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["normalize", "exact_match", "AnswerScore", "split_row", "cut_at"]

_PUNCTUATION = set(string.punctuation)


def normalize(text: str) -> str:
    """`text` lowercased (Unicode-normalised, NFKC), without punctuation (any Unicode punctuation category), its
    whitespace collapsed to single spaces and stripped."""
    text = unicodedata.normalize("NFKC", text).lower()
    kept = "".join(" " if ch in _PUNCTUATION or unicodedata.category(ch).startswith("P") else ch for ch in text)
    return " ".join(kept.split())


def exact_match(answer: str, reference: str) -> bool:
    """Whether `answer` equals `reference` after `normalize`."""
    return normalize(answer) == normalize(reference)


@dataclass
class AnswerScore:
    """Running exact-match accuracy; `examples` keeps the first few (answer, reference) pairs to show."""

    correct: int = 0
    total: int = 0
    examples: list[tuple[str, str, bool]] = field(default_factory=list)
    keep: int = 3

    def add(self, answer: str, reference: str) -> bool:
        hit = exact_match(answer, reference)
        self.correct += hit
        self.total += 1
        if len(self.examples) < self.keep:
            self.examples.append((answer, reference, hit))
        return hit

    @property
    def accuracy(self) -> float | None:
        return self.correct / self.total if self.total else None


def split_row(tokens: torch.Tensor, trained: torch.Tensor) -> tuple[list[int], list[int]] | None:
    """(prompt ids, reference answer ids) of one instruction or chat row: the tokens before the first trained one,
    and the first run of trained tokens (its EOS or end-of-turn token included). None for a row without either."""
    flags = trained.tolist()
    if True not in flags:
        return None
    first = flags.index(True)
    end = flags.index(False, first) if False in flags[first:] else len(flags)
    if first == 0:
        return None
    return tokens[:first].tolist(), tokens[first:end].tolist()


def cut_at(ids: Sequence[int], stops: set[int]) -> list[int]:
    """`ids` up to (not including) the first of `stops` (EOS, end-of-turn and the other special tokens)."""
    out: list[int] = []
    for token in ids:
        if token in stops:
            break
        out.append(token)
    return out

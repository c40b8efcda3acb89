"""The reference workload's data: IMDB reviews (real aclImdb folder or a synthetic stand-in) and batching.

Token ids follow one convention everywhere: 0 is padding, 1 is "unknown", and the other ids are words,
most frequent first. Reviews are truncated to `seq_len` tokens (keeping the beginning) and padded at the end.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from pipetrain.errors import ConfigError, DataError
from pipetrain.workloads.position import replica_shares
from pipetrain.workloads.text.batching import check_batching, num_batches, random_stream
from pipetrain.workloads.text.words import PAD_ID, UNK_ID, Vocabulary, positive, tokenize

__all__ = [
    "PAD_ID",
    "UNK_ID",
    "ReviewDataset",
    "Vocabulary",
    "tokenize",
    "load_aclimdb",
    "synthetic_imdb",
    "batches",
    "num_batches",
    "random_stream",
]

SYNTHETIC_SOURCE = "synthetic IMDB-like corpus (not real reviews)"
ACLIMDB_URL = "https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz"

@dataclass(frozen=True)
class ReviewDataset:
    """Encoded reviews: `tokens` `[N, seq_len]` (int64), `labels` `[N]` (0 negative, 1 positive).

    `source` names the data (printed and recorded); `split` names this part of it: "train", "test" (an
    aclImdb folder's test split), "held-out" (carved from a train split), "synthetic test", ...
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    synthetic: bool
    source: str
    split: str = "test"

    def __post_init__(self) -> None:
        if self.tokens.dim() != 2 or self.tokens.dtype != torch.long:
            raise DataError(
                f"review tokens must be a 2-D int64 tensor, "
                f"got {self.tokens.dtype} of shape {tuple(self.tokens.shape)}",
                hint="encode the reviews to [num_reviews, seq_len] token ids",
            )
        if self.labels.shape != (self.tokens.shape[0],) or self.labels.dtype != torch.long:
            raise DataError(
                f"review labels must be int64 of shape ({self.tokens.shape[0]},), "
                f"got {self.labels.dtype} of shape {tuple(self.labels.shape)}",
                hint="give one 0/1 label per review",
            )

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]


def _review_order(path: Path) -> tuple[int, str]:
    head = path.stem.split("_", 1)[0]
    return (int(head) if head.isdigit() else -1, path.name)


def _review_files(root: Path) -> dict[tuple[str, str], list[Path]]:
    layout_hint = f"expected the aclImdb layout ROOT/{{train,test}}/{{pos,neg}}/*.txt; download {ACLIMDB_URL}"
    if not root.is_dir():
        raise DataError(f"IMDB folder {root} does not exist or is not a folder", hint=layout_hint)
    if not (root / "train").is_dir() and (root / "aclImdb").is_dir():
        layout_hint = f"pass {root / 'aclImdb'} (the extracted folder itself)"
    files = {}
    for split in ("train", "test"):
        for label in ("neg", "pos"):
            folder = root / split / label
            if not folder.is_dir():
                raise DataError(f"IMDB folder {folder} is missing", hint=layout_hint)
            found = sorted(folder.glob("*.txt"), key=_review_order)
            if not found:
                raise DataError(f"IMDB folder {folder} has no .txt reviews", hint=layout_hint)
            files[split, label] = found
    return files


def load_aclimdb(
    root: Path | str, *, seq_len: int, vocab_size: int, limit: int | None = None, min_freq: int = 1
) -> tuple[ReviewDataset, ReviewDataset, Vocabulary]:
    """Train set, test set and the vocabulary (built from the train reviews) of an aclImdb folder.

    `limit` caps the reviews read per split: the first `ceil(limit / 2)` positive and `limit // 2`
    negative files in file-name order. Negative reviews come first in each dataset.
    """
    positive("seq_len", seq_len)
    if limit is not None:
        positive("limit", limit)
    root = Path(root)
    files = _review_files(root)
    texts: dict[str, tuple[list[str], list[int]]] = {}
    for split in ("train", "test"):
        neg, pos = files[split, "neg"], files[split, "pos"]
        if limit is not None:
            neg, pos = neg[: limit // 2], pos[: (limit + 1) // 2]
        reviews = [p.read_text(encoding="utf-8", errors="replace") for p in neg + pos]
        texts[split] = (reviews, [0] * len(neg) + [1] * len(pos))
    vocab = Vocabulary.build(texts["train"][0], max_size=vocab_size, min_freq=min_freq)

    def encode(split: str) -> ReviewDataset:
        reviews, labels = texts[split]
        return ReviewDataset(
            tokens=torch.tensor([vocab.encode(text, seq_len) for text in reviews], dtype=torch.long),
            labels=torch.tensor(labels, dtype=torch.long),
            synthetic=False,
            source=f"aclImdb {split} set at {root} ({len(reviews)} reviews)",
            split=split,
        )

    return encode("train"), encode("test"), vocab


# The synthetic corpus. Lengths: log-normal words per review, median 175 (IMDB's median is ~174, mean ~230,
# range ~10 to ~2500). Words: Zipf-Mandelbrot frequencies over the ids, most frequent first, plus some
# unknown-word ids. Sentiment: each position becomes a sentiment word with probability SENTIMENT_RATE, of the
# review's polarity with probability SENTIMENT_AGREEMENT (else of the opposite one), except in MIXED_REVIEWS
# of the reviews, whose sentiment words are drawn from both polarities alike; the labels of LABEL_NOISE of the
# reviews disagree with their text. So accuracy is capped near 85% however long the reviews.
MEDIAN_WORDS, LENGTH_SIGMA, MIN_WORDS, MAX_WORDS = 175.0, 0.75, 10, 2500
ZIPF_EXPONENT, ZIPF_SHIFT, UNK_RATE = 1.0, 2.7, 0.02
SENTIMENT_WORDS, SENTIMENT_RATE, SENTIMENT_AGREEMENT = 40, 0.06, 0.85
MIXED_REVIEWS, LABEL_NOISE = 0.2, 0.03
MIN_SYNTHETIC_VOCAB = 32


def _sentiment_words(vocab_size: int, seed: int) -> torch.Tensor:
    """`[2, K]` ids: row 0 negative words, row 1 positive words, taken from the mid-frequency ranks."""
    words = vocab_size - 2
    count = min(SENTIMENT_WORDS, words // 8)
    low = min(100, words // 10)
    chosen = torch.randperm(words - low, generator=random_stream(seed, "sentiment-words"))[: 2 * count] + low + 2
    return chosen.view(2, count)


def _synthetic_split(n: int, seq_len: int, vocab_size: int, seed: int, stream: str) -> ReviewDataset:
    """`n` synthetic reviews of the random stream `stream` ("train" or "test")."""
    g = random_stream(seed, stream)
    labels = (torch.arange(n) % 2)[torch.randperm(n, generator=g)]
    noisy = torch.rand(n, generator=g) < LABEL_NOISE
    polarity = labels ^ noisy.long()
    words = torch.exp(math.log(MEDIAN_WORDS) + LENGTH_SIGMA * torch.randn(n, generator=g))
    lengths = words.round().clamp(MIN_WORDS, MAX_WORDS).long().clamp(max=seq_len)

    ranks = torch.arange(vocab_size - 2, dtype=torch.float64)
    cdf = torch.cumsum((ranks + ZIPF_SHIFT) ** -ZIPF_EXPONENT, 0)
    cdf /= cdf[-1].clone()
    draws = torch.rand(n, seq_len, generator=g, dtype=torch.float64)
    tokens = torch.searchsorted(cdf, draws).clamp(max=vocab_size - 3) + 2
    tokens[torch.rand(n, seq_len, generator=g) < UNK_RATE] = UNK_ID

    sentiment = _sentiment_words(vocab_size, seed)
    inject = torch.rand(n, seq_len, generator=g) < SENTIMENT_RATE
    agreement = torch.where(torch.rand(n, generator=g) < MIXED_REVIEWS, 0.5, SENTIMENT_AGREEMENT)
    agrees = torch.rand(n, seq_len, generator=g) < agreement[:, None]
    slot_polarity = torch.where(agrees, polarity[:, None], 1 - polarity[:, None])
    choice = torch.randint(sentiment.shape[1], (n, seq_len), generator=g)
    tokens = torch.where(inject, sentiment[slot_polarity, choice], tokens)
    tokens[torch.arange(seq_len)[None, :] >= lengths[:, None]] = PAD_ID
    return ReviewDataset(
        tokens=tokens,
        labels=labels,
        synthetic=True,
        source=f"{SYNTHETIC_SOURCE}: seed {seed}, vocabulary {vocab_size}, {n} reviews",
        split=f"synthetic {stream}",
    )


def synthetic_imdb(
    *, num_train: int = 25000, num_test: int = 25000, seq_len: int, vocab_size: int, seed: int = 0
) -> tuple[ReviewDataset, ReviewDataset]:
    """A deterministic IMDB-like train and test set (same sentiment words, independent reviews).

    Labels are exactly balanced; a small model learns them well above chance but, by construction
    (few sentiment words in short reviews, mixed-polarity words, label noise), not perfectly.
    """
    positive("num_train", num_train)
    positive("num_test", num_test)
    positive("seq_len", seq_len)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < MIN_SYNTHETIC_VOCAB:
        raise ConfigError(
            f"synthetic IMDB needs vocab_size >= {MIN_SYNTHETIC_VOCAB}, got {vocab_size!r}",
            hint=f"pass vocab_size {MIN_SYNTHETIC_VOCAB} or more",
        )
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed must be an integer, got {seed!r}", hint="pass e.g. seed=0")
    return (
        _synthetic_split(num_train, seq_len, vocab_size, seed, "train"),
        _synthetic_split(num_test, seq_len, vocab_size, seed, "test"),
    )


def batches(
    dataset: ReviewDataset,
    batch_size: int,
    *,
    shuffle: bool,
    seed: int,
    epoch: int,
    replica: int = 0,
    replicas: int = 1,
    drop_last: bool = False,
    start: int = 0,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One epoch of `(tokens, labels)` batches for data-parallel replica `replica` of `replicas`, from global sample
    `start` of the epoch's order on (a resumed job's position: the batches before it are not built).

    The dataset order is a permutation seeded by `(seed, epoch)` when `shuffle`, else the stored order.
    Consecutive global batches of `batch_size` samples are cut into `replicas` equal, contiguous parts,
    so every sample is seen once per epoch by exactly one replica. The last global batch may be short:
    it is dropped when `drop_last`, or when it has fewer samples than replicas (a replica must never get
    an empty batch); otherwise every replica gets the same share, `len // replicas` samples, and the
    fewer than `replicas` samples left over are skipped this epoch. Equal shares keep data-parallel
    gradient averaging exact (every replica's mean carries the same weight).
    """
    check_batching(batch_size, replica, replicas)
    size = len(dataset)
    if shuffle:
        order = torch.randperm(size, generator=random_stream(seed, f"epoch-{epoch}"))
    else:
        order = torch.arange(size)
    for _, part in replica_shares(order, batch_size, replica=replica, replicas=replicas, start=start,
                                  drop_last=drop_last):
        yield dataset.tokens[part], dataset.labels[part]

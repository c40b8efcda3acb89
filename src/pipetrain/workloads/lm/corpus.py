"""The language-model workload's data: a token corpus (synthetic, or a plain-text file/folder) and its batches.

Each sample is one document cut to `seq_len + 1` tokens: the model reads tokens `0..n-2` and predicts
tokens `1..n-1` (next-token targets). Documents vary in length; a batch is padded (`PAD_ID`) to its
longest document, rounded up to a multiple of `LENGTH_STEP`, and padded targets are `IGNORE_INDEX`, so the
token loss skips them. With `bucket`, documents of similar lengths are batched together (less padding).

Real text uses the classifier's word tokenisation (`imdb.tokenize`: lower-case `[a-z0-9']+` words) and a
vocabulary of the most frequent training words (ids 0 padding, 1 unknown). A folder gives one document
per `*.txt` file (recursively, in path order); a single file gives one document per paragraph (blocks of
text separated by blank lines). Files are read as UTF-8, else Latin-1. Every tenth document (the 10th, 20th,
...) is held out as the test set. Without `--data`, the text is the Gutenberg corpus (`load_gutenberg`): each
book cut into windows of `seq_len + 1` words, every tenth window held out.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from pipetrain.data.fields import RowFormat
from pipetrain.data.formats import read_texts, rows_format
from pipetrain.errors import ConfigError, DataError
from pipetrain.pipeline.loss import IGNORE_INDEX
from pipetrain.workloads.position import replica_shares
from pipetrain.workloads.text.batching import LENGTH_STEP, batch_order, padded_length
from pipetrain.workloads.text.gutenberg import GUTENBERG, gutenberg_books, read_text_file, word_windows
from pipetrain.workloads.classifier.imdb import (
    LENGTH_SIGMA,
    MAX_WORDS,
    MEDIAN_WORDS,
    MIN_WORDS,
    PAD_ID,
    Vocabulary,
    random_stream,
    tokenize,
)

__all__ = ["TokenCorpus", "synthetic_corpus", "load_text", "check_text_only", "load_documents", "load_gutenberg", "text_documents",
           "token_batches", "LENGTH_STEP", "MIN_VOCAB", "HOLD_OUT_EVERY"]

#: Smallest vocabulary the synthetic corpus accepts (padding, unknown and some words).
MIN_VOCAB = 16
#: Synthetic grammar: each word is followed by one of SUCCESSORS words (fixed per word) with probability
#: FOLLOW, else by a Zipf-distributed word; a model that learns the successors beats the unigram entropy.
SUCCESSORS, FOLLOW, ZIPF_SHIFT = 4, 0.8, 2.7
HOLD_OUT_EVERY = 10


@dataclass(frozen=True)
class TokenCorpus:
    """Documents as `tokens` `[N, max_len]` (int64, `PAD_ID` after each document's end) and `lengths` `[N]`."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    synthetic: bool
    source: str

    def __post_init__(self) -> None:
        if self.tokens.dim() != 2 or self.tokens.dtype != torch.long or self.lengths.shape != (self.tokens.shape[0],):
            raise DataError(f"a token corpus needs [N, max_len] int64 tokens and [N] lengths, got "
                            f"{tuple(self.tokens.shape)} and {tuple(self.lengths.shape)}",
                            hint="build it with synthetic_corpus or load_text")
        if len(self) and int(self.lengths.min()) < 2:
            raise DataError("every document needs at least 2 tokens (one input, one target)",
                            hint="drop documents shorter than 2 words")

    def __len__(self) -> int:
        return self.tokens.shape[0]


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}", hint=f"pass {name} >= 1")


def _lengths(n: int, max_len: int, g: torch.Generator) -> torch.Tensor:
    # IMDB-like review lengths (log-normal words per review, see imdb.py), cut to the model's window
    words = torch.exp(math.log(MEDIAN_WORDS) + LENGTH_SIGMA * torch.randn(n, generator=g))
    return words.round().clamp(MIN_WORDS, MAX_WORDS).long().clamp(max=max_len)


def _synthetic_split(n: int, max_len: int, vocab_size: int, seed: int, stream: str) -> TokenCorpus:
    grammar = random_stream(seed, "lm-grammar")
    words = vocab_size - 2
    successors = torch.randint(words, (words, SUCCESSORS), generator=grammar) + 2
    ranks = torch.arange(words, dtype=torch.float64)
    zipf = (ranks + ZIPF_SHIFT) ** -1.0
    g = random_stream(seed, stream)
    lengths = _lengths(n, max_len, g)
    tokens = torch.empty(n, max_len, dtype=torch.long)
    tokens[:, 0] = torch.multinomial(zipf, n, replacement=True, generator=g) + 2
    for position in range(1, max_len):
        follow = torch.rand(n, generator=g) < FOLLOW
        pick = torch.randint(SUCCESSORS, (n,), generator=g)
        chained = successors[tokens[:, position - 1] - 2, pick]
        fresh = torch.multinomial(zipf, n, replacement=True, generator=g) + 2
        tokens[:, position] = torch.where(follow, chained, fresh)
    tokens[torch.arange(max_len)[None, :] >= lengths[:, None]] = PAD_ID
    return TokenCorpus(tokens, lengths, True,
                       f"synthetic token corpus (not real text): seed {seed}, vocabulary {vocab_size}, {n} documents")


def synthetic_corpus(*, num_train: int, num_test: int, seq_len: int, vocab_size: int, seed: int = 0
                     ) -> tuple[TokenCorpus, TokenCorpus]:
    """A deterministic train and test corpus: IMDB-like document lengths (median 175 words, cut to
    `seq_len + 1` tokens) over a fixed random word-succession grammar, the same for both splits."""
    for name, value in (("num_train", num_train), ("num_test", num_test), ("seq_len", seq_len)):
        _positive(name, value)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB:
        raise ConfigError(f"the synthetic corpus needs vocab_size >= {MIN_VOCAB}, got {vocab_size!r}",
                          hint=f"use a preset with a vocabulary of {MIN_VOCAB} words or more")
    return (_synthetic_split(num_train, seq_len + 1, vocab_size, seed, "lm-train"),
            _synthetic_split(num_test, seq_len + 1, vocab_size, seed, "lm-test"))


def text_documents(path: Path) -> list[str]:
    """The documents of `--data`: one per `*.txt` file of a folder, one per paragraph of a file."""
    if path.is_dir():
        files = sorted(path.rglob("*.txt"))
        if not files:
            raise DataError(f"text folder {path} has no .txt files", hint="pass a folder of .txt files or one text file")
        return [read_text_file(f) for f in files]
    if not path.is_file():
        raise DataError(f"text data {path} does not exist", hint="pass a plain-text file or a folder of .txt files")
    return [part for part in read_text_file(path).split("\n\n") if part.strip()]


def _encode(texts: list[str], vocab: Vocabulary, max_len: int, source: str) -> TokenCorpus:
    encoded = [[vocab.id_of(w) for w in tokenize(t)[:max_len]] for t in texts]
    encoded = [ids for ids in encoded if len(ids) >= 2]
    tokens = torch.full((len(encoded), max_len), PAD_ID, dtype=torch.long)
    for row, ids in enumerate(encoded):
        tokens[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    lengths = torch.tensor([len(ids) for ids in encoded], dtype=torch.long)
    return TokenCorpus(tokens, lengths, False, f"{source} ({len(encoded)} documents)")


def load_text(path: Path | str, *, seq_len: int, vocab_size: int, row_format: RowFormat = RowFormat()
              ) -> tuple[TokenCorpus, TokenCorpus]:
    """Train and test corpora of a plain-text file or folder (see the module docstring for the rules), or of the
    text field of JSON lines, Parquet or datasets rows (`row_format.text_field`, default `text`: one document a row)."""
    path = Path(path)
    fmt = rows_format(path)
    if fmt is not None:
        with tempfile.TemporaryDirectory(prefix="pipetrain-rows-") as scratch:  # Arrow files, read into memory
            documents = read_texts(path, fmt, row_format, cache_dir=Path(scratch))
        return load_documents(documents, seq_len=seq_len, vocab_size=vocab_size, source=f"{fmt} at {path}")
    check_text_only(row_format, path)
    return load_documents(text_documents(path), seq_len=seq_len, vocab_size=vocab_size, source=f"text at {path}")


def check_text_only(row_format: RowFormat, path: Path) -> None:
    """One ConfigError when field flags are given for plain-text data, which has no fields."""
    given = [f"--{name.replace('_', '-')}" for name, value in row_format.fields().items() if value is not None]
    if given:
        raise ConfigError(f"{', '.join(given)} names fields of JSON lines, Parquet or datasets rows, but --data "
                          f"{str(path)!r} is plain text", hint=f"drop {', '.join(given)}, or pass data with fields")


def load_gutenberg(*, seq_len: int, vocab_size: int) -> tuple[TokenCorpus, TokenCorpus]:
    """Train and held-out corpora of the Gutenberg books: windows of `seq_len + 1` words, every tenth held out."""
    windows = word_windows([text for _, text in gutenberg_books()], seq_len + 1)
    return load_documents(windows, seq_len=seq_len, vocab_size=vocab_size, source=GUTENBERG)


def load_documents(documents: list[str], *, seq_len: int, vocab_size: int, source: str
                   ) -> tuple[TokenCorpus, TokenCorpus]:
    """Train and test corpora of `documents` (every tenth held out), with a word vocabulary of the train split."""
    test = documents[HOLD_OUT_EVERY - 1 :: HOLD_OUT_EVERY]
    train = [d for i, d in enumerate(documents) if i % HOLD_OUT_EVERY != HOLD_OUT_EVERY - 1]
    if not train or not test:
        raise DataError(f"{source} has {len(documents)} document(s); a train and a test split need {HOLD_OUT_EVERY}",
                        hint=f"give at least {HOLD_OUT_EVERY} documents (files, or paragraphs split by blank lines)")
    vocab = Vocabulary.build(train, max_size=vocab_size)
    result = (_encode(train, vocab, seq_len + 1, f"{source}, train split"),
              _encode(test, vocab, seq_len + 1, f"{source}, test split"))
    for split in result:
        if not len(split):
            raise DataError(f"{split.source}: no document has 2 words or more", hint="give longer documents")
    return result


def token_batches(
    corpus: TokenCorpus, batch_size: int, *, shuffle: bool, seed: int, epoch: int,
    replica: int = 0, replicas: int = 1, bucket: bool = False, start: int = 0,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One epoch of `(inputs, targets)` `[share, length]` batches for replica `replica` of `replicas`, from global
    sample `start` of the epoch's order on (`pipetrain.workloads.position`).

    Global batches of `batch_size` documents are cut into equal contiguous shares as in `imdb.batches`
    (same count for every replica; a last short batch smaller than `replicas` is dropped). `length` is the
    longest document of the global batch minus one, rounded up to a multiple of `LENGTH_STEP` (at most
    the corpus width minus one), the same on every replica.
    """
    order = batch_order(corpus.lengths, batch_size, shuffle=shuffle, bucket=bucket, seed=seed,
                        stream=f"lm-epoch-{epoch}", bucket_stream=f"lm-buckets-{epoch}")
    width = corpus.tokens.shape[1] - 1
    for global_batch, part in replica_shares(order, batch_size, replica=replica, replicas=replicas, start=start):
        length = padded_length(corpus.lengths[global_batch] - 1, width)
        tokens = corpus.tokens[part, : length + 1]
        targets = tokens[:, 1:].clone()
        targets[targets == PAD_ID] = IGNORE_INDEX
        yield tokens[:, :-1], targets

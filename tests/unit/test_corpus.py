"""The language-model workload's data: synthetic corpus, plain-text loading, (bucketed) batches."""

from __future__ import annotations

import pytest
import torch

from pipetrain.errors import ConfigError, DataError
from pipetrain.pipeline.loss import IGNORE_INDEX
from pipetrain.train.loop import TrainConfig, load_data
from pipetrain.workloads.lm.corpus import LENGTH_STEP, load_text, synthetic_corpus, token_batches
from pipetrain.workloads.lm.gpt import GPTModel
from pipetrain.workloads import registry
from pipetrain.workloads.classifier.workload import ClassifierWorkload, bucketed_reviews
from pipetrain.workloads.text.batching import MAX_LENGTHS, length_step
from pipetrain.workloads.classifier.imdb import PAD_ID, synthetic_imdb
from pipetrain.workloads.registry import get_workload


@pytest.fixture(scope="module")
def corpus():
    return synthetic_corpus(num_train=400, num_test=50, seq_len=256, vocab_size=200, seed=1)


def test_synthetic_corpus_is_deterministic_with_imdb_like_lengths(corpus):
    train, test = corpus
    again, _ = synthetic_corpus(num_train=400, num_test=50, seq_len=256, vocab_size=200, seed=1)
    assert torch.equal(train.tokens, again.tokens) and train.synthetic and train.tokens.shape == (400, 257)
    lengths = train.lengths.float()
    assert 10 <= lengths.min() and lengths.max() == 257  # reviews of 10 words to a full window
    assert 120 < lengths.median() < 230  # median review ~175 words
    inside = torch.arange(257)[None, :] < train.lengths[:, None]
    assert bool((train.tokens[inside] >= 2).all()) and bool((train.tokens[~inside] == PAD_ID).all())
    assert not torch.equal(test.tokens[:50], train.tokens[:50])


def test_synthetic_corpus_has_structure_to_learn(corpus):
    # each word is mostly followed by one of a few successors: the bigram entropy is far below the unigram one
    tokens = corpus[0].tokens
    pairs = torch.stack([tokens[:, :-1].reshape(-1), tokens[:, 1:].reshape(-1)], 1)
    pairs = pairs[(pairs != PAD_ID).all(1)]
    follows = {}
    for a, b in pairs[:20000].tolist():
        follows.setdefault(a, set()).add(b)
    frequent = sorted(follows, key=lambda a: -len(follows[a]))[:5]
    assert all(len(follows[a]) < 150 for a in frequent)


def test_batches_pad_to_the_longest_rounded_and_ignore_padding(corpus):
    train = corpus[0]
    seen = []
    for x, y in token_batches(train, 32, shuffle=True, seed=0, epoch=1):
        assert x.shape == y.shape and x.shape[1] % LENGTH_STEP == 0 or x.shape[1] == 256
        assert bool(((x == PAD_ID) == (torch.roll(y, 1, 1) == IGNORE_INDEX))[:, 1:].all())
        assert bool((y[x == PAD_ID] == IGNORE_INDEX).all())
        seen.append(x.shape[0])
    assert sum(seen) == 400


def test_bucketing_cuts_padding_and_keeps_every_document(corpus):
    train = corpus[0]

    def padded(bucket):
        tokens = padding = 0
        rows = []
        for x, y in token_batches(train, 16, shuffle=True, seed=0, epoch=2, bucket=bucket):
            tokens += int((y != IGNORE_INDEX).sum())
            padding += int((y == IGNORE_INDEX).sum())
            rows.append(x[:, 0])
        return tokens, padding, torch.cat(rows)

    plain, bucketed = padded(False), padded(True)
    assert plain[0] == bucketed[0] == int((train.lengths - 1).sum())  # the same tokens are trained on
    assert bucketed[1] < plain[1] / 2
    assert sorted(bucketed[2].tolist()) == sorted(train.tokens[:, 0].tolist())


@pytest.mark.parametrize("batch_size", [24, 32, 48])  # 400 documents: a short last batch of 16 each time
def test_bucketed_batches_are_runs_of_the_sorted_lengths(corpus, batch_size):
    spans = sorted(
        (int(lengths.min()), int(lengths.max()))
        for lengths in ((y != IGNORE_INDEX).sum(1) + 1
                        for _, y in token_batches(corpus[0], batch_size, shuffle=True, seed=0, epoch=3, bucket=True))
    )
    assert all(high <= next_low for (_, high), (next_low, _) in zip(spans, spans[1:]))  # no two batches interleave


def test_replicas_get_equal_shares_of_one_length(corpus):
    train = corpus[0]
    a = list(token_batches(train, 32, shuffle=True, seed=0, epoch=1, replica=0, replicas=2, bucket=True))
    b = list(token_batches(train, 32, shuffle=True, seed=0, epoch=1, replica=1, replicas=2, bucket=True))
    assert len(a) == len(b) and all(x.shape == y.shape for (x, _), (y, _) in zip(a, b))


def test_text_folder_and_file(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(20):
        (folder / f"{i:02d}.txt").write_text(f"the cat sat on mat number {i} and the dog ran\n")
    train, test = load_text(folder, seq_len=8, vocab_size=32)
    assert (len(train), len(test)) == (18, 2) and not train.synthetic
    assert train.tokens.shape[1] == 9 and int(train.lengths.max()) == 9
    text = tmp_path / "book.txt"
    text.write_text("\n\n".join(f"paragraph {i} says hello world" for i in range(30)))
    train, test = load_text(text, seq_len=16, vocab_size=64)
    assert (len(train), len(test)) == (27, 3) and int(train.lengths[0]) == 5


@pytest.mark.parametrize("make, message", [
    (lambda p: p / "missing.txt", "does not exist"),
    (lambda p: (p / "empty").mkdir() or p / "empty", "has no .txt files"),
    (lambda p: (p / "short.txt").write_text("one\n\ntwo words") and p / "short.txt", "has 2 document(s)"),
])
def test_bad_text_data_says_what_and_how(tmp_path, make, message):
    with pytest.raises(DataError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        load_text(make(tmp_path), seq_len=8, vocab_size=32)
    assert err.value.hint


def test_lm_workload_from_the_registry():
    config = TrainConfig(workload="lm", preset="tiny", data="synthetic", train_samples=20, test_samples=5, batch_size=4,
                         bucket=True)
    assert isinstance(config.model(), GPTModel)
    train, test = load_data(config)
    assert (len(train), len(test)) == (20, 5)
    assert get_workload("lm").loss().perplexity


def test_bucket_is_refused_where_samples_have_one_length(monkeypatch):
    class OneLength(ClassifierWorkload):
        buckets = False

    monkeypatch.setattr(registry, "_REGISTERED", {"one-length": OneLength})
    with pytest.raises(ConfigError, match="workload 'one-length' has samples of one length"):
        TrainConfig(workload="one-length", preset="tiny", bucket=True)


def test_bucketed_reviews_are_cut_to_their_longest():
    train, _ = synthetic_imdb(num_train=300, num_test=1, seq_len=256, vocab_size=200, seed=2)
    lengths = (train.tokens != PAD_ID).sum(1)
    rows, slots = [], 0
    step = length_step(256)
    assert step == 16 and length_step(128) == length_step(8) == LENGTH_STEP and length_step(512) == 32
    shapes = set()
    for x, y in bucketed_reviews(train, 32, shuffle=True, seed=0, epoch=1, replica=0, replicas=1):
        assert x.shape[1] % step == 0 or x.shape[1] == 256
        assert int((x != PAD_ID).sum(1).max()) > x.shape[1] - step  # cut to its longest review, rounded up
        shapes.add(x.shape[1])
        slots += x.numel()
        rows += [(int((row != PAD_ID).sum()), int(label)) for row, label in zip(x, y)]
    assert slots < 1.25 * int(lengths.sum()) < 0.9 * 300 * 256  # little padding; every review at seq_len: much more
    assert sorted(rows) == sorted(zip(lengths.tolist(), train.labels.tolist()))  # every review once, with its label
    assert len(shapes) <= MAX_LENGTHS  # the engine's default shape cache keeps every schedule
    assert get_workload("classifier").buckets

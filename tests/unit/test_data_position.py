"""The data position (pipetrain.workloads.position): the samples of a step are a function of (seed, epoch, global
sample index) alone — the same under any number of replicas — and a resumed epoch seeks to its position instead of
building the batches before it; `--max-steps` alone is the run's length (the epochs follow)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import pytest
import torch

from pipetrain.checkpoint.durable import Position
from pipetrain.errors import ConfigError
from pipetrain.train.config import TrainConfig
from pipetrain.train.loop import _length
from pipetrain.workloads.base import Workload
from pipetrain.workloads.classifier.imdb import batches as review_batches
from pipetrain.workloads.classifier.imdb import synthetic_imdb
from pipetrain.workloads.classifier.workload import bucketed_reviews
from pipetrain.workloads.hf.text import TokenWindows, window_batches
from pipetrain.workloads.lm.corpus import TokenCorpus, synthetic_corpus, token_batches
from pipetrain.workloads.registry import get_workload
from pipetrain.workloads.evaluation import evaluation_batches, evaluation_share
from pipetrain.workloads.position import batches_left, replica_shares
from pipetrain.workloads.text.batching import batch_order

BATCH = 8
SIZE = 60  # 7 full global batches and one of 4: every replica count below gets a share of the last one


@pytest.fixture(scope="module")
def corpus() -> TokenCorpus:
    return synthetic_corpus(num_train=SIZE, num_test=10, seq_len=24, vocab_size=64, seed=1)[0]


@pytest.fixture(scope="module")
def reviews():
    return synthetic_imdb(num_train=SIZE, num_test=10, seq_len=24, vocab_size=64, seed=1)[0]


def _windows(corpus: TokenCorpus) -> TokenWindows:
    return TokenWindows(corpus.tokens, corpus.lengths, 0, True, "windows")


# each built-in way of cutting an epoch into batches, as f(data, replica=, replicas=, start=) -> batches
MAKERS = {
    "reviews": lambda c, r: lambda **kw: review_batches(r, BATCH, shuffle=True, seed=5, epoch=2, **kw),
    "reviews-bucketed": lambda c, r: lambda **kw: bucketed_reviews(r, BATCH, shuffle=True, seed=5, epoch=2, **kw),
    "tokens": lambda c, r: lambda **kw: token_batches(c, BATCH, shuffle=True, seed=5, epoch=2, **kw),
    "tokens-bucketed": lambda c, r: lambda **kw: token_batches(c, BATCH, shuffle=True, seed=5, epoch=2, bucket=True, **kw),
    "windows": lambda c, r: lambda **kw: window_batches(_windows(c), BATCH, shuffle=True, seed=5, epoch=2, **kw),
}


def _joined(make, replicas: int, start: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches as the replicas' shares put back together (padding trimmed to the global length)."""
    shares = [list(make(replica=r, replicas=replicas, start=start)) for r in range(replicas)]
    assert len({len(s) for s in shares}) == 1  # every replica takes the same number of steps
    return [(torch.cat([s[i][0] for s in shares]), torch.cat([s[i][1] for s in shares])) for i in range(len(shares[0]))]


@pytest.mark.parametrize("kind", MAKERS)
def test_the_samples_of_every_step_do_not_depend_on_the_replicas_and_a_seek_lands_on_them(kind, corpus, reviews):
    make = MAKERS[kind](corpus, reviews)
    whole = _joined(make, 1)
    assert len(whole) == 8 and len(whole[-1][1]) == 4
    for replicas in (2, 4):
        for start in (0, 3 * BATCH, 7 * BATCH):
            got = _joined(make, replicas, start)
            want = whole[start // BATCH :]
            assert len(got) == len(want)
            for (x, y), (wx, wy) in zip(got, want):
                assert torch.equal(x, wx) and torch.equal(y, wy)
    assert list(make(replica=0, replicas=2, start=SIZE)) == []  # the end of the epoch: nothing left


class _Rows:
    """A tensor's rows, recording which are read (the sample indices a batch function touches)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.read = tensor, set()

    def __getitem__(self, index):
        rows = index[0] if isinstance(index, tuple) else index
        self.read.update(torch.as_tensor(rows).reshape(-1).tolist())
        return self.tensor[index]

    @property
    def shape(self):
        return self.tensor.shape


def test_a_seek_reads_no_sample_before_the_position(corpus):
    """A resumed epoch computes where its next batch is: the samples of the batches before it are not read (a
    replay through the skipped batches would read every one of them)."""
    rows = _Rows(corpus.tokens)
    seen = _Corpus(rows, corpus.lengths)
    start = 5 * BATCH
    order_head = torch.cat([b[0] for b in replica_shares(_order(corpus), BATCH, replica=0, replicas=1)])[:start]
    for replica in range(2):
        list(token_batches(seen, BATCH, shuffle=True, seed=5, epoch=2, replica=replica, replicas=2, start=start))
    assert rows.read and not rows.read & set(order_head.tolist())
    assert len(rows.read) == SIZE - start


def _order(corpus: TokenCorpus) -> torch.Tensor:
    return batch_order(corpus.lengths, BATCH, shuffle=True, bucket=False, seed=5, stream="lm-epoch-2",
                       bucket_stream="lm-buckets-2")


@dataclass
class _Corpus:
    tokens: object
    lengths: torch.Tensor

    def __len__(self) -> int:
        return len(self.lengths)


def test_batches_left_counts_from_the_position():
    assert batches_left(60, 8) == 8 and batches_left(60, 8, start=56) == 1 and batches_left(60, 8, start=60) == 0
    assert batches_left(58, 8, replicas=4, start=48) == 1  # 10 left: one full batch, the 2 after it dropped
    with pytest.raises(ConfigError, match="outside an epoch of 60"):
        batches_left(60, 8, start=64)


class _Old(Workload):
    """A workload written before `batches` took `start`."""

    name, summary, presets = "old", "old", {"p": None}

    def model(self, preset, *, seq_len=None):
        raise NotImplementedError

    def load_data(self, request):
        raise NotImplementedError

    def batches(self, dataset, batch_size, *, shuffle, seed, epoch, replica, replicas, bucket=False):
        return iter(range(0, len(dataset), batch_size))

    def num_batches(self, dataset, batch_size, *, replicas):
        return -(-len(dataset) // batch_size)

    def loss(self):
        raise NotImplementedError


class _New(_Old):
    def batches(self, dataset, batch_size, *, shuffle, seed, epoch, replica, replicas, bucket=False, start=0):
        return iter(range(start, len(dataset), batch_size))


def test_a_workload_without_start_still_resumes_by_skipping_and_one_with_it_is_asked_to_seek():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an old subclass is accepted as it is: no warning
        old = _Old()
    data = list(range(40))
    assert not old.seeks and _New().seeks
    for workload in (old, _New()):
        assert list(workload.batches_from(data, 8, seed=0, epoch=1, replica=0, replicas=1, start=24)) == [24, 32]


def test_a_checkpoint_from_before_the_sample_position_resumes_at_its_batches():
    assert Position(in_epoch=3, sample=None).start(8) == 24
    assert Position(in_epoch=3, sample=21).start(8) == 21


def test_max_steps_alone_is_the_run_length_and_with_epochs_a_cap(corpus):
    alone = TrainConfig(workload="lm", preset="tiny", data="synthetic", batch_size=BATCH, max_steps=30)
    assert alone.epochs is None and alone.total_steps(corpus) == 30 and alone.epochs_of(corpus) == 4  # 8 a epoch
    capped = TrainConfig(workload="lm", preset="tiny", data="synthetic", batch_size=BATCH, max_steps=30, epochs=2)
    assert capped.total_steps(corpus) == 16 and capped.epochs_of(corpus) == 2
    plain = TrainConfig(workload="lm", preset="tiny", data="synthetic", batch_size=BATCH)
    assert plain.epochs == 2 and plain.total_steps(corpus) == 16


def test_the_start_up_line_says_the_steps_and_the_epochs_they_take(corpus):
    lm = get_workload("lm")
    alone = TrainConfig(workload="lm", preset="tiny", data="synthetic", batch_size=BATCH, max_steps=30)
    assert _length(alone, lm, corpus) == "30 steps, 4 epochs of 8 batches (from --max-steps)"
    plain = TrainConfig(workload="lm", preset="tiny", data="synthetic", batch_size=BATCH, epochs=1)
    assert _length(plain, lm, corpus) == "8 steps, 1 epoch of 8 batches"


@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
def test_an_evaluation_counts_every_sample_of_a_batch_once(replicas):
    """Each replica's evaluation share of a global batch of 1..9 samples: all of the same size, the counted rows
    (leading) cover every sample exactly once, in order; the filled-up rows repeat a real sample (main's equal
    training shares skipped the remainder: 3 samples at dp 2 counted 2)."""
    for samples in range(1, 10):
        shares = [evaluation_share(samples, replica=r, replicas=replicas) for r in range(replicas)]
        assert len({len(index) for index, _ in shares}) == 1
        counted = torch.cat([index[:n] for index, n in shares])
        assert counted.tolist() == list(range(samples)), (samples, shares)
        assert all(0 <= int(i) < samples for index, _ in shares for i in index)
    assert evaluation_share(3, replica=3, replicas=4)[1] == 0  # a replica with no sample still runs one


def test_evaluation_batches_keep_a_samples_rows_together():
    """A workload of two rows a sample (a preference pair): the shares cut between samples, and every replica's
    batch is the rows of its samples from the global batch built whole."""

    class Pairs:
        rows_per_sample = 2

        def batches(self, dataset, batch_size, *, replicas, **kwargs):
            assert replicas == 1
            for start in range(0, len(dataset), batch_size):
                part = dataset[start:start + batch_size]
                rows = torch.stack([part * 10, part * 10 + 1], dim=1).flatten()
                yield (rows[:, None], rows[:, None] + 1000), rows

    data = torch.arange(5)  # batches of 4 and 1 pairs
    got = [list(evaluation_batches(Pairs(), data, 4, seed=0, replica=r, replicas=2)) for r in range(2)]
    assert [[rows for _, rows in shares] for shares in got] == [[4, 2], [4, 0]]
    assert got[0][0][0][1].tolist() == [0, 1, 10, 11] and got[1][0][0][1].tolist() == [20, 21, 30, 31]
    assert got[1][1][0][1].tolist() == [40, 41] and got[1][1][0][0][1].flatten().tolist() == [1040, 1041]

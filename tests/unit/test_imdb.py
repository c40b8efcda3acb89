"""Tests of the IMDB data: tokenizer, vocabulary, aclImdb loader, synthetic corpus and sharded batching."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipetrain.errors import ConfigError, DataError
from pipetrain.workloads.classifier.imdb import (
    PAD_ID,
    UNK_ID,
    ReviewDataset,
    Vocabulary,
    batches,
    load_aclimdb,
    num_batches,
    synthetic_imdb,
    tokenize,
)

REVIEWS = {
    ("train", "pos"): ["A great film.<br /><br />Great acting!", "Loved it, great fun", "Great great great"],
    ("train", "neg"): ["A dull film. Awful<br/>acting", "Awful, just awful", "I didn't like it"],
    ("test", "pos"): ["Great zebra film", "Truly great"],
    ("test", "neg"): ["Awful zebra film", "Dull"],
}


def make_aclimdb(root: Path) -> Path:
    for (split, label), texts in REVIEWS.items():
        folder = root / split / label
        folder.mkdir(parents=True)
        for i, text in enumerate(texts):
            (folder / f"{i}_{8 if label == 'pos' else 2}.txt").write_text(text, encoding="utf-8")
    (root / "train" / "unsup").mkdir()  # present in the real archive, ignored
    return root


def dataset(n: int) -> ReviewDataset:
    return ReviewDataset(
        tokens=torch.arange(n).unsqueeze(1).repeat(1, 3), labels=torch.arange(n) % 2, synthetic=True, source="t"
    )


# --- tokenizer and vocabulary -------------------------------------------------------------------------


def test_tokenize():
    text = "Great MOVIE!<br /><br />I loved it... Don't miss 2<BR>films"
    assert tokenize(text) == ["great", "movie", "i", "loved", "it", "don't", "miss", "2", "films"]
    assert "br" not in tokenize("a<br />b<br/>c<br>d")


def test_vocabulary_order_size_and_min_freq():
    texts = ["b a a c", "a b d", "e e"]
    vocab = Vocabulary.build(texts, max_size=10)
    assert vocab.words == ("<pad>", "<unk>", "a", "b", "e", "c", "d")
    assert Vocabulary.build(texts, max_size=4).words == ("<pad>", "<unk>", "a", "b")
    assert Vocabulary.build(texts, max_size=10, min_freq=2).words == ("<pad>", "<unk>", "a", "b", "e")
    with pytest.raises(ConfigError):
        Vocabulary.build(texts, max_size=1)


def test_encode_truncates_pads_and_marks_unknown_words():
    vocab = Vocabulary.build(["good film good"], max_size=10)
    good, film = vocab.id_of("good"), vocab.id_of("film")
    assert vocab.encode("Good film, bad", 6) == [good, film, UNK_ID, PAD_ID, PAD_ID, PAD_ID]
    assert vocab.encode("film good film good", 2) == [film, good]
    assert vocab.encode("", 2) == [PAD_ID, PAD_ID]


# --- aclImdb loader -----------------------------------------------------------------------------------


def test_load_aclimdb(tmp_path):
    root = make_aclimdb(tmp_path / "aclImdb")
    train, test, vocab = load_aclimdb(root, seq_len=5, vocab_size=50)
    assert train.tokens.shape == (6, 5) and test.tokens.shape == (4, 5)
    assert train.labels.tolist() == [0, 0, 0, 1, 1, 1] and test.labels.tolist() == [0, 0, 1, 1]
    assert not train.synthetic and "aclImdb" in train.source
    assert "zebra" not in vocab.words  # the vocabulary only sees the training reviews
    assert vocab.words[2] == "great"  # the most frequent training word
    great, film = vocab.id_of("great"), vocab.id_of("film")
    assert test.tokens[2].tolist() == [great, UNK_ID, film, PAD_ID, PAD_ID]
    assert train.tokens[5].tolist() == [great] * 3 + [PAD_ID] * 2


def test_load_aclimdb_limit(tmp_path):
    root = make_aclimdb(tmp_path)
    train, test, _ = load_aclimdb(root, seq_len=4, vocab_size=50, limit=3)
    assert train.labels.tolist() == [0, 1, 1] and test.labels.tolist() == [0, 1, 1]
    with pytest.raises(ConfigError):
        load_aclimdb(root, seq_len=4, vocab_size=50, limit=0)


def test_missing_root(tmp_path):
    with pytest.raises(DataError, match="does not exist") as info:
        load_aclimdb(tmp_path / "nowhere", seq_len=4, vocab_size=50)
    assert str(tmp_path / "nowhere") in info.value.message and "aclImdb" in info.value.hint


def test_parent_of_extracted_folder_gets_a_pointed_hint(tmp_path):
    make_aclimdb(tmp_path / "aclImdb")
    with pytest.raises(DataError) as info:
        load_aclimdb(tmp_path, seq_len=4, vocab_size=50)
    assert str(tmp_path / "aclImdb") in info.value.hint


@pytest.mark.parametrize("split, label", [("train", "pos"), ("train", "neg"), ("test", "pos"), ("test", "neg")])
def test_missing_or_empty_subfolder(tmp_path, split, label):
    root = make_aclimdb(tmp_path)
    folder = root / split / label
    for path in folder.iterdir():
        path.unlink()
    (folder / "notes.md").write_text("not a review")
    with pytest.raises(DataError, match="no .txt reviews") as info:
        load_aclimdb(root, seq_len=4, vocab_size=50)
    assert str(folder) in info.value.message
    for path in folder.iterdir():
        path.unlink()
    folder.rmdir()
    with pytest.raises(DataError, match="missing") as info:
        load_aclimdb(root, seq_len=4, vocab_size=50)
    assert str(folder) in info.value.message


# --- synthetic corpus ---------------------------------------------------------------------------------


def test_synthetic_is_deterministic_and_seeded():
    a_train, a_test = synthetic_imdb(num_train=300, num_test=200, seq_len=64, vocab_size=500, seed=5)
    b_train, b_test = synthetic_imdb(num_train=300, num_test=200, seq_len=64, vocab_size=500, seed=5)
    c_train, _ = synthetic_imdb(num_train=300, num_test=200, seq_len=64, vocab_size=500, seed=6)
    assert torch.equal(a_train.tokens, b_train.tokens) and torch.equal(a_test.labels, b_test.labels)
    assert not torch.equal(a_train.tokens, c_train.tokens)
    assert not torch.equal(a_train.tokens[:200], a_test.tokens)


def test_synthetic_labels_metadata_and_id_range():
    train, test = synthetic_imdb(num_train=1000, num_test=501, seq_len=32, vocab_size=300)
    assert train.labels.sum() == 500 and test.labels.sum() == 250
    for data in (train, test):
        assert data.synthetic and "synthetic IMDB-like corpus (not real reviews)" in data.source
        assert data.tokens.dtype == torch.long and data.tokens.shape[1] == 32
        assert data.tokens.min() >= 0 and data.tokens.max() < 300
        assert (data.tokens == UNK_ID).any()


def test_synthetic_lengths_look_like_imdb():
    train, _ = synthetic_imdb(num_train=3000, num_test=1, seq_len=1500, vocab_size=1000)
    lengths = (train.tokens != PAD_ID).sum(1)
    assert 150 <= lengths.median() <= 200
    assert lengths.min() >= 10 and (lengths >= 1000).any() and (lengths == 1500).any()
    # Padding only at the end of each review.
    positions = torch.arange(1500).expand_as(train.tokens)
    assert torch.equal(train.tokens == PAD_ID, positions >= lengths[:, None])


def test_synthetic_rejects_bad_sizes():
    with pytest.raises(ConfigError, match="vocab_size"):
        synthetic_imdb(seq_len=8, vocab_size=10)
    with pytest.raises(ConfigError, match="num_train"):
        synthetic_imdb(num_train=0, seq_len=8, vocab_size=100)


def bag_of_words(data: ReviewDataset, vocab_size: int) -> torch.Tensor:
    features = torch.zeros(len(data), vocab_size)
    features.scatter_(1, data.tokens, 1.0)
    features[:, :2] = 0  # padding and unknown carry no sentiment
    return features


def test_synthetic_sentiment_is_learnable_but_not_trivial():
    vocab_size = 1000
    train, test = synthetic_imdb(num_train=4000, num_test=2000, seq_len=128, vocab_size=vocab_size, seed=3)
    x_train, x_test = bag_of_words(train, vocab_size), bag_of_words(test, vocab_size)
    y = train.labels.float()
    weight, bias = torch.zeros(vocab_size), torch.zeros(())
    for _ in range(300):  # full-batch gradient descent on L2-regularised logistic regression
        error = torch.sigmoid(x_train @ weight + bias) - y
        weight -= 0.5 * (x_train.T @ error / len(y) + 1e-3 * weight)
        bias -= 0.5 * error.mean()
    accuracy = ((x_test @ weight + bias > 0).long() == test.labels).float().mean().item()
    assert 0.70 < accuracy < 0.95


# --- batching -----------------------------------------------------------------------------------------


def collect(data, batch_size, replicas, **kwargs):
    return [list(batches(data, batch_size, replica=r, replicas=replicas, **kwargs)) for r in range(replicas)]


@pytest.mark.parametrize("n, batch_size, replicas", [(103, 10, 2), (100, 10, 2), (42, 12, 4), (9, 8, 1)])
def test_every_sample_once_per_epoch_across_replicas(n, batch_size, replicas):
    data = dataset(n)
    per_replica = collect(data, batch_size, replicas, shuffle=True, seed=1, epoch=0)
    seen = [i for shards in per_replica for tokens, _ in shards for i in tokens[:, 0].tolist()]
    assert len(seen) == len(set(seen))  # never twice
    # all but the fewer-than-replicas samples the short last batch cannot share equally
    assert len(seen) == n - (n % batch_size) % replicas
    expected = num_batches(data, batch_size, replicas=replicas)
    assert all(len(shards) == expected for shards in per_replica)
    for step in range(expected - (1 if n % batch_size else 0)):  # full global batches split equally
        assert all(len(shards[step][0]) == batch_size // replicas for shards in per_replica)
    for shards in per_replica:
        for tokens, labels in shards:
            assert torch.equal(labels, tokens[:, 0] % 2)  # labels travel with their samples


def test_short_last_batch_gives_every_replica_the_same_share():
    per_replica = collect(dataset(31), 8, 4, shuffle=False, seed=0, epoch=0)
    assert [len(shards) for shards in per_replica] == [4, 4, 4, 4]
    # 7 samples left for 4 replicas: one each, the 3 left over are skipped this epoch
    assert [shards[-1][0][:, 0].tolist() for shards in per_replica] == [[24], [25], [26], [27]]
    assert per_replica[1][0][0][:, 0].tolist() == [2, 3]


def test_last_batch_smaller_than_replicas_is_dropped():
    data = dataset(27)  # 3 full batches of 8, then 3 samples for 4 replicas
    assert num_batches(data, 8, replicas=4) == 3
    per_replica = collect(data, 8, 4, shuffle=False, seed=0, epoch=0)
    assert all(len(shards) == 3 for shards in per_replica)
    seen = sorted(i for shards in per_replica for tokens, _ in shards for i in tokens[:, 0].tolist())
    assert seen == list(range(24))
    assert num_batches(data, 8, replicas=2) == 4


def test_drop_last():
    data = dataset(30)
    assert num_batches(data, 8, drop_last=True) == 3 and num_batches(data, 8) == 4
    assert [len(t) for t, _ in batches(data, 8, shuffle=True, seed=0, epoch=0, drop_last=True)] == [8, 8, 8]
    assert num_batches(32, 8, drop_last=True) == 4


def test_shuffle_depends_on_seed_and_epoch_only():
    data = dataset(50)

    def order(**kwargs):
        return torch.cat([t[:, 0] for t, _ in batches(data, 10, **kwargs)]).tolist()

    base = order(shuffle=True, seed=0, epoch=0)
    assert base == order(shuffle=True, seed=0, epoch=0)
    assert base != order(shuffle=True, seed=0, epoch=1)
    assert base != order(shuffle=True, seed=1, epoch=0)
    assert sorted(base) == list(range(50)) and base != list(range(50))
    assert order(shuffle=False, seed=0, epoch=0) == list(range(50))
    assert order(shuffle=False, seed=0, epoch=3) == list(range(50))


def test_batching_errors():
    data = dataset(10)
    with pytest.raises(ConfigError, match="not divisible by 3 replicas"):
        next(batches(data, 8, shuffle=False, seed=0, epoch=0, replicas=3))
    with pytest.raises(ConfigError, match="replica 2"):
        next(batches(data, 8, shuffle=False, seed=0, epoch=0, replica=2, replicas=2))
    with pytest.raises(ConfigError, match="batch_size"):
        num_batches(data, 0)


def test_dataset_validation():
    with pytest.raises(DataError):
        ReviewDataset(tokens=torch.zeros(3, 4), labels=torch.zeros(3, dtype=torch.long), synthetic=False, source="")
    with pytest.raises(DataError):
        ReviewDataset(
            tokens=torch.zeros(3, 4, dtype=torch.long),
            labels=torch.zeros(2, dtype=torch.long),
            synthetic=False,
            source="",
        )
    assert len(dataset(4)) == 4 and dataset(4).seq_len == 3

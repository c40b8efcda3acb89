"""Bad data rows: one message each naming the value and the fix, exit 2, no rank started: a missing field (naming
the fields found), a chat row without an assistant turn, a tokenizer without a chat template for `messages` rows,
a `.parquet` file that is not Parquet, a dataset left empty by the truncation, field flags on plain text, an empty
file, bytes that are not UTF-8, a line that is not JSON (its 1-based line number), a chat role the template does not
know; a refused run leaves no lock file in the cache folder."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("datasets")

from pipetrain.data import cache as data_cache  # noqa: E402
from tests.hf_folders import tiny_model_folder  # noqa: E402
from tests.unit.test_cli_errors import assert_one_error, cli  # noqa: E402,F401

TRAIN = ["train", "--workload", "hf", "--seq-len", "32", "--max-steps", "1", "--no-progress"]
CHAT = {"messages": [{"role": "user", "content": "Is it good?"}, {"role": "assistant", "content": "yes"}]}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"chat": tiny_model_folder(root / "chat", chat=True), "plain": tiny_model_folder(root / "plain")}


@pytest.fixture(autouse=True)
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setattr(data_cache, "default_cache_root", lambda: tmp_path / "cache")


def jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


CASES = {
    "missing-field": (["--text-field", "body"], "rows.jsonl", [{"text": "a b", "id": 1}] * 20,
                      ["--text-field 'body' is not a field of", "the fields found are 'text', 'id'"]),
    "no-known-field": ([], "rows.jsonl", [{"review": "a b", "label": 1}] * 20,
                       ["has no field pipetrain knows how to train on", "the fields found are 'review', 'label'",
                        "--text-field NAME"]),
    "no-answer-field": (["--answer-field", "reply"], "rows.jsonl", [{"prompt": "a", "completion": "b"}] * 20,
                        ["--answer-field 'reply' is not a field of", "'prompt', 'completion'"]),
    "no-assistant": ([], "chat.jsonl", [CHAT] * 3 + [{"messages": [{"role": "user", "content": "Hi?"}]}] + [CHAT] * 16,
                     ["row 4 of", "is a chat without an assistant turn (roles: user)", "add its answer"]),
    "no-template": (["--model-plain"], "chat.jsonl", [CHAT] * 20,
                    ["the tokenizer of plain has no chat template", "prompt/completion"]),
    "not-parquet": ([], "rows.parquet", None, ["rows.parquet' is not a Parquet file", "Parquet magic bytes",
                                               "to_parquet"]),
    "empty-after-truncation": (["--seq-len", "8"], "rows.jsonl",
                               [{"prompt": "a long prompt " * 5, "completion": " yes"}] * 20,
                               ["no example is left: all 20 rows are longer than --seq-len 8", "--truncate left"]),
    "empty-file": ([], "rows.jsonl", "", ["rows.jsonl' is empty: it holds no row", "one JSON object a line"]),
    "not-utf8": ([], "rows.jsonl", b'{"text": "a b"}\n' * 3 + b'{"text": "caf\xe9"}\n' + b'{"text": "a b"}\n' * 16,
                 ["line 4 of", "is not UTF-8 text: byte 0xe9 at column 14", "save the file as UTF-8"]),
    "malformed-line": ([], "rows.jsonl", "".join('{"text": "row %d"}\n' % i if i != 499 else '{"text": "open\n'
                                                 for i in range(1000)),
                       ["line 500 of", "is not one JSON object: a string opened at column 10 is not closed",
                        "fix or remove that line"]),
    "stray-brace": ([], "rows.jsonl", "".join('{"text": "row %d"}\n' % i if i != 499 else '}\n' for i in range(1000)),
                    ["line 500 of", "a value is missing at column 1"]),
    "unknown-role": ([], "chat.jsonl", [CHAT] * 5 + [{"messages": [{"role": "usr", "content": "Hi?"},
                                                                   {"role": "assistant", "content": "yes"}]}] + [CHAT] * 14,
                     ["row 6 of", "has the role(s) 'usr', which the chat template does not know",
                      "roles found in the row: usr, assistant", "accepted: assistant, system, tool, user", "'usr' -> 'user'"]),
    "field-on-text": (["--prompt-field", "q"], "notes.txt", None, ["--prompt-field names fields of JSON lines",
                                                                  "is plain text"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_rows_are_one_message(case, cli, folders, tmp_path, capsys):  # noqa: F811
    flags, name, rows, expected = CASES[case]
    data = tmp_path / name
    if isinstance(rows, bytes):
        data.write_bytes(rows)
    elif isinstance(rows, str):
        data.write_text(rows)
    elif rows is not None:
        jsonl(data, rows)
    else:
        data.write_text("not a parquet file, only text\n\nand a second paragraph\n")
    model = folders["plain" if "--model-plain" in flags else "chat"]
    argv = [*TRAIN, "--model", str(model), "--data", str(data), *[f for f in flags if f != "--model-plain"]]
    capsys.readouterr()
    code, out, err, _ = cli(argv)
    assert_one_error(code, out, err, *expected)
    assert not list((tmp_path / "cache").glob(".tokens-*")), "a refused run left a lock or a build folder behind"


def test_rows_without_the_data_extra_say_how_to_install_it(monkeypatch):
    import sys

    from pipetrain.data.formats import require_datasets
    from pipetrain.errors import ConfigError

    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed: `import datasets` raises ImportError
    with pytest.raises(ConfigError, match=r"needs the `datasets` and `pyarrow` packages.*pip install 'pipetrain\[data\]'"):
        require_datasets()


def test_a_tokenizer_without_eos_is_refused_before_tokenizing(cli, tmp_path, monkeypatch, capsys):  # noqa: F811
    """Prompt/answer rows end with EOS: main tokenized them first and failed inside Arrow (`None` in an int list)."""
    from tests.hf_folders import tiny_model_folder

    folder = tiny_model_folder(tmp_path / "no-eos")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("eos_token", None)
    config.pop("bos_token", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    called = []
    monkeypatch.setattr(data_cache, "_tokenize", lambda *a, **k: called.append(1))
    data = jsonl(tmp_path / "qa.jsonl", [{"prompt": "a", "completion": "b"}] * 20)
    capsys.readouterr()
    code, out, err, _ = cli([*TRAIN, "--model", str(folder), "--data", str(data)])
    assert_one_error(code, out, err, "the tokenizer of no-eos has no EOS token", "set eos_token")
    assert not called, "the rows were tokenized before the EOS check"

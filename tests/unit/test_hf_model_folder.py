"""`--workload hf --model DIR`: the folder's own tokenizer, packing into windows or one document per row, and bad
folders refused with one message each (no tokenizer, an unsupported family, a GGUF file)."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pipetrain.pipeline.loss import IGNORE_INDEX  # noqa: E402
from pipetrain.train.loop import TrainConfig, load_data  # noqa: E402
from pipetrain.workloads.hf.text import TokenWindows, tokenize_documents, window_batches  # noqa: E402
from tests.hf_folders import tiny_model_folder, tiny_tokenizer  # noqa: E402
from tests.unit.test_cli_errors import assert_one_error, cli  # noqa: E402,F401

DOCS = [f"Document {i}: the cat sat on the mat {i} times." for i in range(40)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("model") / "tiny-llama")


def test_packed_windows_join_documents_with_eos_and_overlap_by_one_token():
    tok = tiny_tokenizer()
    train, test = tokenize_documents(DOCS, tok, seq_len=8, vocab_size=len(tok), pack=True, source="docs")
    stream = [t for d in DOCS for t in (*tok(d, add_special_tokens=False)["input_ids"], tok.eos_token_id)]
    rows = [stream[i * 8 : i * 8 + 9] for i in range((len(stream) - 1) // 8)]
    assert torch.equal(test.tokens, torch.tensor(rows[9::10]))  # every 10th window held out
    assert torch.equal(train.tokens, torch.tensor([r for i, r in enumerate(rows) if i % 10 != 9]))
    assert bool((train.lengths == 9).all()) and train.packed and tok.eos_token_id in train.tokens
    x, y = next(window_batches(train, 4, shuffle=False, seed=0, epoch=0))
    assert torch.equal(x, train.tokens[:4, :-1]) and torch.equal(y, train.tokens[:4, 1:])  # no padding, nothing ignored


def test_unpacked_rows_are_padded_and_padding_is_ignored_by_position():
    tok = tiny_tokenizer()
    train, _ = tokenize_documents(DOCS, tok, seq_len=64, vocab_size=len(tok), pack=False, source="docs")
    ids = tok(DOCS[0], add_special_tokens=False)["input_ids"]
    assert int(train.lengths[0]) == len(ids) < 65 and train.tokens[0, : len(ids)].tolist() == ids
    x, y = next(window_batches(train, 2, shuffle=False, seed=0, epoch=0))
    assert y[0, : len(ids) - 1].tolist() == ids[1:]
    assert bool((y[0, len(ids) - 1 :] == IGNORE_INDEX).all())
    # the pad id (EOS, id 0) is a real token where it is one: a row ending in EOS keeps that target
    assert train.pad_id == tok.eos_token_id == 0


def test_a_model_folder_trains_on_its_own_tokenizers_ids(folder, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("\n\n".join(DOCS))
    config = TrainConfig(workload="hf", model_dir=folder, data=text, seq_len=16, batch_size=4, max_steps=1)
    train, test = load_data(config)
    assert isinstance(train, TokenWindows) and config.window == 16 and config.model().tied
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert train.tokens[0].tolist() == tok("\n\n".join(DOCS[:1]), add_special_tokens=False)["input_ids"][:17]
    assert "tokenized by tiny-llama" in train.source and "held-out" in test.source


def _folder_of(tmp_path, **changes):
    folder = tiny_model_folder(tmp_path / "m", tokenizer=changes.pop("tokenizer", True))
    if "model_type" in changes:
        config = json.loads((folder / "config.json").read_text())
        config["model_type"] = changes["model_type"]
        (folder / "config.json").write_text(json.dumps(config))
    return folder


TRAIN_HF = ["train", "--workload", "hf", "--seq-len", "16", "--max-steps", "1", "--no-progress"]


@pytest.mark.parametrize("case", ["no-tokenizer", "unsupported-family", "gguf-file", "gguf-folder", "missing",
                                  "model-on-lm", "no-pack-without-model", "pack-documents-without-model"])
def test_bad_model_folders_are_one_message(case, cli, tmp_path, capsys):  # noqa: F811
    expected = {
        "no-tokenizer": ["has no tokenizer", "tokenizer.json", "save_pretrained"],
        "unsupported-family": ["holds a 'bert' model", "no model.embed_tokens", "supported model types: llama, gpt2"],
        "gguf-file": ["is a GGUF file", "convert it once", "--model OUT_DIR"],
        "gguf-folder": ["holds a GGUF file (model.Q4.gguf) but no config.json", "convert it once"],
        "missing": ["is not a folder"],
        "model-on-lm": ["workload 'lm' does not train a pretrained model folder", "--workload hf"],
        "no-pack-without-model": ["--pack none applies to a pretrained model's text"],
        "pack-documents-without-model": ["--pack documents applies to a pretrained model's text", "--model DIR"],
    }[case]
    argv = list(TRAIN_HF)
    if case == "no-tokenizer":
        argv += ["--model", str(_folder_of(tmp_path, tokenizer=False))]
    elif case == "unsupported-family":
        argv += ["--model", str(_folder_of(tmp_path, model_type="bert"))]
    elif case == "gguf-file":
        (tmp_path / "model.Q4.gguf").write_bytes(b"GGUF")
        argv += ["--model", str(tmp_path / "model.Q4.gguf")]
    elif case == "gguf-folder":
        (tmp_path / "model.Q4.gguf").write_bytes(b"GGUF")
        argv += ["--model", str(tmp_path)]
    elif case == "missing":
        argv += ["--model", str(tmp_path / "nowhere")]
    elif case == "model-on-lm":
        argv = ["train", "--workload", "lm", "--model", str(tmp_path), "--no-progress"]
    elif case == "pack-documents-without-model":
        argv += ["--pack", "documents"]
    else:
        argv += ["--no-pack"]  # the old spelling of --pack none (deprecated)
    capsys.readouterr()  # transformers' progress bar of save_pretrained
    if case == "no-pack-without-model":
        with pytest.warns(DeprecationWarning, match="--no-pack is deprecated: pass --pack none"):
            code, out, err, _ = cli(argv)
    else:
        code, out, err, _ = cli(argv)
    assert_one_error(code, out, err, *expected)

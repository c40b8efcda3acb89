"""Instruction and chat rows (supervised fine-tuning): the chat template renders `messages`, only the answers (the
assistant turns, with their end-of-turn tokens; a completion and its EOS) train, every other target is the
ignore index; rows longer than the window are dropped or cut from the left, and the start-up line counts them."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("datasets")

from pipetrain.data import cache as data_cache  # noqa: E402
from pipetrain.data.fields import RowFormat  # noqa: E402
from pipetrain.pipeline.loss import IGNORE_INDEX  # noqa: E402
from pipetrain.train.config import TrainConfig, load_data  # noqa: E402
from pipetrain.workloads.hf.text import window_batches  # noqa: E402
from tests.hf_folders import chat_tokenizer, tiny_model_folder  # noqa: E402

SYSTEM = {"role": "system", "content": "Answer in one word."}


def chat(i: int) -> dict:
    """A conversation of two exchanges: the assistant's words are `yes {i}` and `no {i}`."""
    return {"messages": [SYSTEM, {"role": "user", "content": f"Is {i} small?"},
                         {"role": "assistant", "content": f"yes {i}"},
                         {"role": "user", "content": f"Is {i} big?"}, {"role": "assistant", "content": f"no {i}"}]}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("model") / "tiny-chat", chat=True)


@pytest.fixture(autouse=True)
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setattr(data_cache, "default_cache_root", lambda: tmp_path / "cache")


def jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def load(folder, data, seq_len=128, **fmt):
    config = TrainConfig(workload="hf", model_dir=folder, data=data, seq_len=seq_len, batch_size=4, max_steps=1,
                         row_format=RowFormat(**fmt))
    return load_data(config)


def trained_text(tok, x, y, length) -> tuple[str, str]:
    """A row of `length` tokens as the model reads it, each trained token's text in [brackets], and the trained
    text alone (target j is token j + 1)."""
    marked, alone = [], []
    for token, target in zip(x.tolist()[:length], [None] + y.tolist()):
        text = tok.decode([token])
        marked.append(f"[{text}]" if target not in (None, IGNORE_INDEX) else text)
        if target not in (None, IGNORE_INDEX):
            alone.append(text)
    return "".join(marked), "".join(alone)


def test_chat_rows_train_on_the_assistant_turns_only(folder, tmp_path):
    train, _ = load(folder, jsonl(tmp_path / "chat.jsonl", [chat(i) for i in range(20)]))
    assert train.supervised and "chat rows" in train.source and "assistant turns trained" in train.source
    tok = chat_tokenizer()
    x, y = next(window_batches(train, 2, shuffle=False, seed=0, epoch=0))
    marked, alone = trained_text(tok, x[0], y[0], int(train.lengths[0]))
    print(marked)
    rendered = tok.apply_chat_template(chat(0)["messages"], tokenize=False)
    assert x[0, : len(tok(rendered, add_special_tokens=False)["input_ids"])].tolist() == \
        tok(rendered, add_special_tokens=False)["input_ids"]  # the template's own rendering, token for token
    assert alone == "yes 0<|im_end|>\nno 0<|im_end|>\n"
    assert "[" not in marked.split("assistant\n")[0]  # system and user turns: not one target
    # a target is trained exactly where the mask says so: the rest (prompts, padding) is the ignore index
    _, mask = train.take(torch.tensor([0]))
    assert torch.equal(y[0] != IGNORE_INDEX, mask[0, 1:])


def test_prompt_completion_rows_train_on_the_completion_and_its_eos(folder, tmp_path):
    rows = [{"question": f"What is {i} plus {i}?", "reply": f" {2 * i}", "id": i} for i in range(20)]
    train, _ = load(folder, jsonl(tmp_path / "qa.jsonl", rows), prompt_field="question", answer_field="reply")
    assert "instruction rows" in train.source and "answers trained" in train.source
    tok = chat_tokenizer()
    x, y = next(window_batches(train, 2, shuffle=False, seed=0, epoch=0))
    marked, alone = trained_text(tok, x[1], y[1], int(train.lengths[1]))
    print(marked)
    assert alone == " 2<|endoftext|>"
    assert marked.startswith("What is 1 plus 1?[")


def test_truncation_drops_long_rows_or_cuts_their_prompts_from_the_left(folder, tmp_path):
    tok = chat_tokenizer()
    short = [{"prompt": f"Q{i}:", "completion": " yes"} for i in range(18)]
    long_prompt = {"prompt": "word " * 40 + "Q:", "completion": " no"}
    long_answer = {"prompt": "Q:", "completion": " word" * 40}
    data = jsonl(tmp_path / "rows.jsonl", [*short, long_prompt, long_answer])
    train, test = load(folder, data, seq_len=24)  # drop, the default
    assert len(train) + len(test) == 18 and "2 dropped (--truncate drop)" in train.source
    train, test = load(folder, data, seq_len=24, truncate="left")
    assert len(train) + len(test) == 19 and "1 dropped, 1 cut from the left (--truncate left)" in train.source
    cut = next(i for i in range(len(train)) if int(train.offsets[i]) > 0)
    tokens, mask = train.take(torch.tensor([cut]))
    full = tok("word " * 40 + "Q:", add_special_tokens=False)["input_ids"] + tok(" no", add_special_tokens=False)[
        "input_ids"] + [tok.eos_token_id]
    assert int(train.lengths[cut]) == 25 and tokens[0].tolist() == full[-25:]  # the last 25 tokens: the prompt's end
    assert tok.decode(tokens[0][mask[0]]) == " no<|endoftext|>" and not bool(mask[0, 0])


def test_data_show_prints_the_rows_with_the_trained_tokens_marked(folder, tmp_path, capsys):
    from pipetrain.cli.main import main

    data = jsonl(tmp_path / "chat.jsonl", [chat(i) for i in range(20)])
    capsys.readouterr()
    assert main(["data", "show", "--data", str(data), "--model", str(folder), "--rows", "2"]) == 0
    out = capsys.readouterr().out
    print(out)
    assert "JSON lines at" in out and "chat rows" in out and out.count("--- sample") == 2
    assert "assistant\n[[yes 0<|im_end|>\n]]<|im_start|>user\nIs 0 big?" in out
    assert "[[no 1<|im_end|>\n]]" in out and "[[" not in out.split("--- sample 0")[1].split("assistant\n")[0]

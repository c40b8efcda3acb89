"""Chat rows and prompt/answer rows tokenized as each model family's tokenizer and chat template make them: the real
chat templates of Llama 3, Gemma, Mistral, Phi-3 and Qwen3 (tests/fixtures/chat_templates) around tokenizers built
offline in their manner; multi-turn rows train on exactly their assistant turns and each turn's end-of-turn text;
a template with `{% generation %}` marks gives its own mask; a template whose turns cannot be found is one line;
text and prompt/answer rows carry BOS (and EOS) as `tokenizer(text)` gives them."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from pipetrain.data.render import prompt_answer_ids, tokenize_rows  # noqa: E402
from pipetrain.errors import ConfigError, DataError  # noqa: E402
from pipetrain.generate.prompts import encode_prompts  # noqa: E402
from tests.hf_folders import chat_tokenizer, styled_tokenizer  # noqa: E402

SYSTEM = [{"role": "system", "content": "Be brief."}]
TURNS = [{"role": "user", "content": "Is it good?"}, {"role": "assistant", "content": "It was the best of times."},
         {"role": "user", "content": "And the dog?"}, {"role": "assistant", "content": "The dog sat on the log."},
         {"role": "user", "content": "And the cat?"}, {"role": "assistant", "content": "The cat sat on the mat."}]
#: family -> (a system message allowed, each assistant turn's end-of-turn text, the last turn's)
FAMILIES = {
    "llama3": (True, "<|eot_id|>", "<|eot_id|>"),
    "qwen3": (True, "<|im_end|>\n", "<|im_end|>\n"),
    "gemma": (False, "<end_of_turn>\n", "<end_of_turn>\n"),
    "mistral": (False, "</s>", "</s>"),
    "phi3": (True, "<|end|>\n", "<|end|>\n<|endoftext|>"),
}


def trained_runs(tokenizer, row):
    """The runs of consecutive trained tokens of one tokenized chat row, each decoded."""
    out = tokenize_rows({"messages": [row]}, [0], tokenizer=tokenizer, kind="chat", fields=("messages",), source="x")
    runs, run = [], []
    for token, trains in zip(out["input_ids"][0], out["trained"][0]):
        if trains:
            run.append(token)
        elif run:
            runs, run = runs + [run], []
    runs += [run] if run else []
    return [tokenizer.decode(r) for r in runs], out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_template_trains_exactly_the_assistant_turns(family):
    system, end, last = FAMILIES[family]
    tokenizer = styled_tokenizer(family, family)
    row = (SYSTEM if system else []) + TURNS
    runs, out = trained_runs(tokenizer, row)
    assistant = [m["content"] for m in TURNS if m["role"] == "assistant"]
    assert runs == [text + end for text in assistant[:-1]] + [assistant[-1] + last]
    # the ids are those of the whole conversation as the template renders it (its BOS included)
    assert out["input_ids"][0] == tokenizer(tokenizer.apply_chat_template(row, tokenize=False),
                                            add_special_tokens=False)["input_ids"]


def test_qwen3_trains_the_answer_not_the_think_block_it_adds_to_the_last_turn():
    tokenizer = styled_tokenizer("qwen3", "qwen3")
    full = tokenizer.apply_chat_template(TURNS, tokenize=False)
    assert full.count("<think>") == 1  # the last turn alone: what made the prefix check of main refuse the row
    runs, _ = trained_runs(tokenizer, TURNS)
    assert all("think" not in run for run in runs) and len(runs) == 3


def test_a_template_with_generation_marks_gives_its_own_mask():
    tokenizer = chat_tokenizer()
    tokenizer.chat_template = (styled_tokenizer.__globals__["TEMPLATES"] / "chatml_generation.jinja").read_text()
    runs, _ = trained_runs(tokenizer, SYSTEM + TURNS)
    assert runs == [m["content"] + "<|im_end|>\n" for m in TURNS if m["role"] == "assistant"]


def test_a_template_whose_assistant_turns_cannot_be_found_is_one_error():
    tokenizer = chat_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] | upper }}\n{% endfor %}")
    with pytest.raises(ConfigError, match=r"assistant turns cannot be found in row 1 of x: the content of turn 2 is "
                                          r"not rendered as given"):
        trained_runs(tokenizer, TURNS[:2])


def test_unknown_roles_name_the_roles_found_and_accepted():
    with pytest.raises(DataError, match=r"row 1 of x has the role\(s\) 'usr'.*accepted: assistant, system, tool, user"):
        trained_runs(styled_tokenizer("llama3", "llama3"), [{"role": "usr", "content": "a"}, TURNS[1]])


@pytest.mark.parametrize("family", ["llama3", "gemma", "mistral"])
def test_text_and_prompt_answer_rows_carry_bos_and_eos_as_the_tokenizer_gives_them(family):
    tokenizer = styled_tokenizer(family)
    text = "The capital of France is Paris."
    out = tokenize_rows({"text": [text]}, [0], tokenizer=tokenizer, kind="text", fields=("text",), source="x")
    assert out["input_ids"][0] == tokenizer(text)["input_ids"] and out["input_ids"][0][0] == tokenizer.bos_token_id
    prompt, answer = "The capital of France is", " Paris."
    ids, first = prompt_answer_ids(tokenizer, prompt, answer)
    # the concatenation is the whole's tokenization (BOS first), then EOS; the prompt is what generation reads
    assert ids == tokenizer(prompt + answer)["input_ids"] + [tokenizer.eos_token_id]
    assert ids[:first] == tokenizer(prompt)["input_ids"] == encode_prompts(tokenizer, [prompt])[0]
    assert tokenizer.decode(ids[first:-1]).strip() == answer.strip()


def test_a_prompt_and_answer_merged_by_the_tokenizer_are_tokenized_apart():
    """SentencePiece (`▁` for a space): a prompt ending in a space puts it in the answer's first token; the two are
    then tokenized apart, the prompt exactly as generation reads it."""
    tokenizer = styled_tokenizer("mistral")
    prompt, answer = "The capital of France is ", "Paris."
    whole = tokenizer(prompt + answer)["input_ids"]
    ids, first = prompt_answer_ids(tokenizer, prompt, answer)
    assert ids[:first] == tokenizer(prompt)["input_ids"] and ids[:-1] != whole
    assert ids[first:] == tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def test_the_rows_tokenized_apart_are_counted():
    tokenizer = styled_tokenizer("mistral")
    batch = {"prompt": ["The capital of France is ", "The capital of France is"], "completion": ["Paris.", " Paris."]}
    out = tokenize_rows(batch, [0, 1], tokenizer=tokenizer, kind="instruction", fields=("prompt", "completion"),
                        source="x")
    assert out["apart"] == [1, 0]


def test_packing_puts_one_eos_between_documents_whatever_the_tokenizer_adds():
    """A tokenizer that ends every text with EOS itself gets no second one between packed documents."""
    datasets = pytest.importorskip("datasets")
    from tokenizers import processors

    from pipetrain.data.rows import token_rows
    from pipetrain.workloads.hf.text import ends_with_eos, tokenize_documents

    tokenizer = styled_tokenizer("llama3")
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A <|eot_id|>", special_tokens=[("<|begin_of_text|>", bos), ("<|eot_id|>", eos)])
    assert ends_with_eos(tokenizer) and not ends_with_eos(styled_tokenizer("llama3"))
    texts = [f"It was the best of times, {i}." for i in range(20)]
    out = tokenize_rows({"text": texts}, list(range(20)), tokenizer=tokenizer, kind="text", fields=("text",), source="x")
    rows = datasets.Dataset.from_dict(out)
    train, _ = token_rows(rows, kind="text", seq_len=8, pack=True, truncate="drop", pad_id=eos, eos_id=eos,
                          source="x", joiner=0)
    stream = [t for i, text in enumerate(texts) if i % 10 != 9 for t in tokenizer(text)["input_ids"]]
    windows = train.take(torch.arange(len(train)))[0]
    assert windows[:, :-1].flatten().tolist() == stream[: len(train) * 8]
    docs, _ = tokenize_documents(texts, tokenizer, seq_len=8, vocab_size=10_000, pack=True, source="x")
    whole = [t for text in texts for t in tokenizer(text)["input_ids"]]  # .txt documents: held out by window
    assert docs.tokens[:9, :-1].flatten().tolist() == whole[:72]

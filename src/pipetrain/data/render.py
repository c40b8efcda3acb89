"""Rows to token ids and the mask of the tokens that train: plain text (every token), a prompt and its answer (the
answer and the EOS after it), or a chat (`messages`, rendered with the tokenizer's own chat template: the assistant
turns, their end-of-turn tokens included). `tokenize_rows` takes one batch of rows as `datasets.Dataset.map` hands
it over, and is what `cache` runs over the whole dataset. Row numbers in messages are 1-based.

Special tokens are those the tokenizer gives: plain text is `tokenizer(text)` (its BOS, and its EOS where it adds
one); a prompt and its answer are `tokenizer(prompt + answer)` plus EOS, the answer being the tokens that start at
or after the prompt's last character — where a token of the whole spans the joint (the tokenizer merges the two
across it) they are tokenized apart instead, the prompt as `tokenizer(prompt)` gives it (as generation reads it),
the answer without special tokens.

A chat's assistant turns: where the template marks them (`{% generation %}`), its own mask (transformers'
`return_assistant_tokens_mask`); else each is found by rendering the conversation with that turn's content
replaced by a sentinel (`chat.assistant_spans`), so templates that render a turn differently by its place (Qwen3's
think block on the last turn, Phi-3's trailing EOS) are masked exactly; see `chat`.
"""

from __future__ import annotations

from typing import Any

from pipetrain.data.chat import assistant_spans, check_chat_template, check_roles, marks_generation
from pipetrain.errors import DataError

#: `check_chat_template` and `assistant_spans` live in `pipetrain.data.chat`; their names here are kept
__all__ = ["check_chat_template", "tokenize_rows", "assistant_spans", "text_ids", "prompt_answer_ids"]


def _text(value: Any, field: str, index: int, source: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"row {index + 1} of {source}: field {field!r} is {type(value).__name__} {value!r:.60}, not "
                        "text", hint="every row needs text in that field; remove or fix the row")
    return value


def text_ids(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Each text's ids as `tokenizer(text)` gives them (its BOS, and its EOS where it adds one)."""
    return [list(ids) for ids in tokenizer(texts)["input_ids"]]


def prompt_answer_ids(tokenizer: Any, prompt: str, answer: str, *, apart: list[bool] | None = None
                      ) -> tuple[list[int], int]:
    """The ids of `prompt + answer` followed by EOS (unless the tokenizer ended them with it) and how many of them
    are the prompt's: the whole's tokenization where a token starts at the joint, else the two tokenized apart
    (the prompt with the tokenizer's special tokens, the answer without; `apart` is told which, when given)."""
    eos = tokenizer.eos_token_id
    whole = tokenizer(prompt + answer, return_offsets_mapping=True, return_special_tokens_mask=True)
    ids, joint = list(whole["input_ids"]), len(prompt)
    first, merged = len(ids), False
    for i, ((start, end), special) in enumerate(zip(whole["offset_mapping"], whole["special_tokens_mask"])):
        if special:
            continue
        if start < joint < end:
            merged = True
            break
        if start >= joint:
            first = i
            break
    if apart is not None:
        apart.append(merged)
    if merged:
        head = list(tokenizer(prompt)["input_ids"])
        if head and head[-1] == eos:
            head = head[:-1]
        ids, first = head + list(tokenizer(answer, add_special_tokens=False)["input_ids"]), len(head)
    else:
        while first > 0 and whole["special_tokens_mask"][first - 1] and ids[first - 1] == eos:
            first -= 1  # an EOS the tokenizer put after the prompt (an empty answer) belongs to the answer
    if not ids or ids[-1] != eos:
        ids.append(eos)
    return ids, first


def tokenize_rows(batch: dict[str, list], indices: list[int], *, tokenizer: Any, kind: str, fields: tuple[str, ...],
                  source: str) -> dict[str, list]:
    """Token ids (`input_ids`), their count (`length`) and, for instruction and chat rows, which tokens train
    (`trained`, 0/1) and where the first of them is (`first`) of one batch of rows."""
    if kind == "text":
        ids = text_ids(tokenizer, [_text(v, fields[0], i, source) for v, i in zip(batch[fields[0]], indices)])
        return {"input_ids": ids, "length": [len(row) for row in ids]}
    ids, trained = [], []
    if kind == "instruction":
        apart: list[bool] = []
        for prompt, answer, index in zip(batch[fields[0]], batch[fields[1]], indices):
            row, first = prompt_answer_ids(tokenizer, _text(prompt, fields[0], index, source),
                                           _text(answer, fields[1], index, source), apart=apart)
            ids.append(row)
            trained.append([0] * first + [1] * (len(row) - first))
        return {"input_ids": ids, "trained": trained, "length": [len(row) for row in ids],
                "first": [row.index(1) if 1 in row else len(row) for row in trained],
                "apart": [int(a) for a in apart]}
    else:
        generation = marks_generation(tokenizer)
        for messages, index in zip(batch[fields[0]], indices):
            if generation:
                messages = check_roles(tokenizer, messages, index, source)
                encoded = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                        return_assistant_tokens_mask=True)
                ids.append(list(encoded["input_ids"]))
                trained.append([int(bool(flag)) for flag in encoded["assistant_masks"]])
                continue
            full, spans = assistant_spans(tokenizer, messages, index, source)
            encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
            ids.append(list(encoded["input_ids"]))
            trained.append([int(any(s <= start < e for s, e in spans)) for start, _ in encoded["offset_mapping"]])
    return {"input_ids": ids, "trained": trained, "length": [len(row) for row in ids],
            "first": [row.index(1) if 1 in row else len(row) for row in trained]}

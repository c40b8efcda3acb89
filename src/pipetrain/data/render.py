"""Rows to token ids and the mask of the tokens that train: plain text (every token), a prompt and its answer (the
answer and the EOS after it), or a chat (`messages`, rendered with the tokenizer's own chat template: the assistant
turns, their end-of-turn tokens included). `tokenize_rows` takes one batch of rows as `datasets.Dataset.map` hands
it over, and is what `cache` runs over the whole dataset.

A chat's assistant turns are found as text: turn `k` spans from the end of the template's rendering of the turns
before it with the generation prompt, to the end of its rendering of the turns up to it; the whole conversation is
then tokenized once and a token trains when it starts inside such a span (`return_offsets_mapping`), so the ids
are exactly those of the rendered conversation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipetrain.errors import ConfigError, DataError

__all__ = ["check_chat_template", "tokenize_rows", "assistant_spans"]


def check_chat_template(tokenizer: Any, name: str) -> None:
    """One ConfigError when `tokenizer` has no chat template (chat rows need one) or is not a fast tokenizer."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"the tokenizer of {name} has no chat template, which rows of 'messages' need",
                          hint="use the tokenizer of the model's instruct or chat version (its tokenizer_config.json "
                               "or chat_template.jinja holds the template), or give the rows as prompt/completion")
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(f"the tokenizer of {name} is not a fast (Rust) tokenizer: chat rows need its offsets",
                          hint="save the model's tokenizer.json beside it (AutoTokenizer.from_pretrained(...)"
                               ".save_pretrained(DIR))")


def _text(value: Any, field: str, index: int, source: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"row {index} of {source}: field {field!r} is {type(value).__name__} {value!r:.60}, not text",
                        hint="every row needs text in that field; remove or fix the row")
    return value


def assistant_spans(tokenizer: Any, messages: Sequence[dict], index: int, source: str) -> tuple[str, list[tuple[int, int]]]:
    """The conversation `messages` rendered by the chat template, and the character spans of its assistant turns."""
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise DataError(f"row {index} of {source}: 'messages' is not a list of {{role, content}} messages",
                        hint="write each row's messages as [{\"role\": \"user\", \"content\": ...}, ...]")
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        raise DataError(f"row {index} of {source} is a chat without an assistant turn (roles: {', '.join(roles) or 'none'})",
                        hint="every chat row needs an assistant message to train on: add its answer or remove the row")
    messages = [dict(m, content=_text(m.get("content"), "content", index, source)) for m in messages]

    def render(turns: Sequence[dict], prompt: bool = False) -> str:
        return tokenizer.apply_chat_template(list(turns), tokenize=False, add_generation_prompt=prompt)

    full, spans = render(messages), []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, upto = render(messages[:k], prompt=True), render(messages[: k + 1])
        if not (upto.startswith(before) and full.startswith(upto)):
            raise ConfigError(f"the chat template does not render row {index} of {source} turn by turn (the text of "
                              f"its first {k} turns with the generation prompt is not the start of the conversation)",
                              hint="use a template that renders a conversation as the sum of its turns, or give "
                                   "the rows as prompt/completion")
        spans.append((len(before), len(upto)))
    return full, spans


def tokenize_rows(batch: dict[str, list], indices: list[int], *, tokenizer: Any, kind: str, fields: tuple[str, ...],
                  source: str) -> dict[str, list]:
    """Token ids (`input_ids`), their count (`length`) and, for instruction and chat rows, which tokens train
    (`trained`, 0/1) and where the first of them is (`first`) of one batch of rows."""
    if kind == "text":
        texts = [_text(v, fields[0], i, source) for v, i in zip(batch[fields[0]], indices)]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        return {"input_ids": ids, "length": [len(row) for row in ids]}
    if kind == "instruction":
        prompts = tokenizer([_text(v, fields[0], i, source) for v, i in zip(batch[fields[0]], indices)],
                            add_special_tokens=False)["input_ids"]
        answers = tokenizer([_text(v, fields[1], i, source) for v, i in zip(batch[fields[1]], indices)],
                            add_special_tokens=False)["input_ids"]
        eos = tokenizer.eos_token_id
        ids = [p + a + [eos] for p, a in zip(prompts, answers)]
        trained = [[0] * len(p) + [1] * (len(a) + 1) for p, a in zip(prompts, answers)]
    else:
        ids, trained = [], []
        for messages, index in zip(batch[fields[0]], indices):
            full, spans = assistant_spans(tokenizer, messages, index, source)
            encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
            ids.append(encoded["input_ids"])
            trained.append([int(any(s <= start < e for s, e in spans)) for start, _ in encoded["offset_mapping"]])
    return {"input_ids": ids, "trained": trained, "length": [len(row) for row in ids],
            "first": [row.index(1) if 1 in row else len(row) for row in trained]}

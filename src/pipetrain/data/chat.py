"""Where a chat template puts the assistant turns: the character spans of each assistant turn's content and its
end-of-turn text in the rendered conversation, found for any template, and the checks of chat rows (roles the
template knows, an assistant turn to train on).

Turn `k`'s span is found by rendering the conversation once more with that turn's content replaced by a sentinel:
the text before the sentinel is the conversation's start up to the turn's content (`prefix`), the text after it
what follows the content (`rest`); the real rendering is `prefix + content as rendered + rest`, whatever the
template does to the content (Llama 3 trims it, Qwen3 moves its think block out) or to the other turns by their
place (Qwen3 adds an empty think block to the last turn only, Phi-3 an EOS after the last turn). The end-of-turn
text is the start of `rest` that the turn's own rendering as the last turn ends with (`<|im_end|>\\n`, `<|eot_id|>`,
`<end_of_turn>\\n`, `</s>`, Phi-3's `<|end|>\\n`, and its EOS after the last turn). A template whose rendering does
not keep the turns apart so (the sentinel missing, or the rest of the conversation changing with the content) is
refused with one line.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from pipetrain.errors import ConfigError, DataError

__all__ = ["ROLES", "check_chat_template", "check_known_roles", "check_roles", "marks_generation", "template_roles",
           "assistant_spans"]

#: the roles every chat template is given (besides those its text names)
ROLES = ("system", "user", "assistant", "tool")
_SENTINEL = "PipetrainSentinel{}x"
_ROLE_NAME = re.compile(r"""role['"]?\]?\s*(?:==|!=)\s*['"]([A-Za-z_][\w-]*)['"]""")
_GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")


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


def _template(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return template if isinstance(template, str) else "\n".join(str(t) for t in dict(template).values())


def marks_generation(tokenizer: Any) -> bool:
    """Whether the chat template marks the assistant turns itself (`{% generation %}` ... `{% endgeneration %}`)."""
    return bool(_GENERATION.search(_template(tokenizer)))


def template_roles(tokenizer: Any) -> tuple[str, ...]:
    """The roles a chat row may have: `ROLES` and every role the template's text compares a message's role with."""
    return tuple(sorted(set(ROLES) | set(_ROLE_NAME.findall(_template(tokenizer)))))


def check_known_roles(tokenizer: Any, roles: Sequence[Any], index: int, source: str) -> None:
    """One DataError naming the roles found and accepted when row `index` (0-based; said 1-based) of `source` has
    `roles` that the chat template does not know."""
    known = template_roles(tokenizer)
    unknown = [r for r in dict.fromkeys(roles) if r not in known]
    if unknown:
        raise DataError(f"row {index + 1} of {source} has the role(s) {', '.join(map(repr, unknown))}, which the chat "
                        f"template does not know (roles found in the row: {', '.join(map(str, dict.fromkeys(roles)))}; "
                        f"accepted: {', '.join(known)})", hint="fix the role names of that row (e.g. 'usr' -> 'user')")


def check_roles(tokenizer: Any, messages: Any, index: int, source: str) -> list[dict]:
    """The messages of row `index` (0-based; said 1-based) with their contents checked as text; one DataError when
    they are not a list of {role, content}, have a role the template does not know, or no assistant turn."""
    row = f"row {index + 1} of {source}"
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise DataError(f"{row}: 'messages' is not a list of {{role, content}} messages",
                        hint="write each row's messages as [{\"role\": \"user\", \"content\": ...}, ...]")
    roles = [m["role"] for m in messages]
    check_known_roles(tokenizer, roles, index, source)
    if "assistant" not in roles:
        raise DataError(f"{row} is a chat without an assistant turn (roles: {', '.join(roles) or 'none'})",
                        hint="every chat row needs an assistant message to train on: add its answer or remove the row")
    out = []
    for m in messages:
        if not isinstance(m.get("content"), str):
            raise DataError(f"{row}: a {m['role']!r} message's 'content' is {type(m.get('content')).__name__} "
                            f"{m.get('content')!r:.60}, not text", hint="every message needs text content; fix the row")
        out.append(dict(m))
    return out


def _render(tokenizer: Any, messages: Sequence[dict]) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=False)


def _refuse(index: int, source: str, why: str) -> ConfigError:
    return ConfigError(f"the chat template's assistant turns cannot be found in row {index + 1} of {source}: {why}",
                       hint="use a template that renders each message's content as given (or mark the assistant "
                            "turns with {% generation %}), or give the rows as prompt/completion")


def _token_ends(tokenizer: Any, text: str) -> list[int]:
    return [end for _, end in tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]]


def _common_tokens(ends: list[int], last: str, rest: str) -> int:
    """How many characters of `rest` (what follows a turn's content) are the start of `last` (what follows it when it
    is the last turn; its tokens end at `ends`), up to the end of one of `last`'s tokens (`<|end|>\n` of
    `<|end|>\n<|endoftext|>` against `<|end|>\n<|user|>`, not `<|end|>\n<|`)."""
    return max([end for end in ends if rest[:end] == last[:end]], default=0)


def assistant_spans(tokenizer: Any, messages: Sequence[dict], index: int, source: str) -> tuple[str, list[tuple[int, int]]]:
    """The conversation `messages` (row `index`, 0-based, of `source`; checked by `check_roles`) rendered by the chat template, and the character spans
    of its assistant turns: each turn's content as rendered and its end-of-turn text (see the module docstring)."""
    messages = check_roles(tokenizer, messages, index, source)
    full = _render(tokenizer, messages)
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    around = {k: _around(tokenizer, messages, k, full, index, source) for k in turns}
    # what follows a turn rendered as the last one: the last message's, when it is an assistant turn (one render
    # fewer a turn; a template ends a conversation the same way whichever turn is last), else rendered for each
    ending = around[turns[-1]][1] if turns[-1] == len(messages) - 1 else None
    ending_ends = _token_ends(tokenizer, ending) if ending is not None else []
    spans = []
    for k in turns:
        prefix, rest = around[k]
        last = ending if ending is not None else _last(tokenizer, messages, k)
        ends = ending_ends if ending is not None else _token_ends(tokenizer, last)
        spans.append((len(prefix), len(full) - len(rest) + _common_tokens(ends, last, rest)))
    return full, spans


def _around(tokenizer: Any, messages: Sequence[dict], k: int, full: str, index: int, source: str) -> tuple[str, str]:
    """The text of the conversation before and after the content of turn `k` (rendered with a sentinel there)."""
    sentinel = _SENTINEL.format(k)
    text = _render(tokenizer, [dict(m, content=sentinel) if j == k else m for j, m in enumerate(messages)])
    if text.count(sentinel) != 1 or sentinel in full:
        raise _refuse(index, source, f"the content of turn {k + 1} is not rendered as given")
    prefix, rest = text.split(sentinel)
    if not (full.startswith(prefix) and full.endswith(rest) and len(prefix) + len(rest) <= len(full)):
        raise _refuse(index, source, f"the text around turn {k + 1} changes with its content")
    return prefix, rest


def _last(tokenizer: Any, messages: Sequence[dict], k: int) -> str:
    """What follows the content of turn `k` when the conversation ends with it."""
    sentinel = _SENTINEL.format(k)
    alone = _render(tokenizer, [*messages[:k], dict(messages[k], content=sentinel)])
    return alone.split(sentinel)[1] if alone.count(sentinel) == 1 else ""

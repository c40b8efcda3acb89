"""Which fields of a row hold the text (`--text-field`, `--prompt-field`, `--answer-field`, a `messages` chat) and
what a row longer than the window does (`--truncate drop|left`): `RowFormat`, and `row_kind` that reads it against
the fields a dataset has; how rows fill windows (`--pack`, `pack_mode`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from pipetrain.errors import ConfigError

__all__ = ["RowFormat", "TRUNCATE", "KINDS", "row_kind", "PACK_MODES", "pack_mode"]

#: what a row longer than the window does: `drop` it, or cut its prompt from the `left` (the answer is kept whole;
#: a row whose answer alone is longer than the window is dropped)
TRUNCATE = ("drop", "left")
#: the kinds of rows: plain `text` (every token trains), `instruction` (prompt + answer, the answer trains) and
#: `chat` (`messages` rendered with the tokenizer's chat template, the assistant turns train)
KINDS = ("text", "instruction", "chat")
#: `--pack`: none (one document per row, padded), windows (a stream cut into windows: attention crosses documents),
#: documents (whole documents per window, attention and positions per document)
PACK_MODES = ("none", "windows", "documents")


def pack_mode(value: str | bool) -> str:
    """`value` as one of `PACK_MODES` (True is "windows", False "none", the old `--pack/--no-pack`)."""
    if isinstance(value, bool):
        return "windows" if value else "none"
    if value not in PACK_MODES:
        raise ConfigError(f"--pack {value!r} is not a packing", hint=f"pass --pack {'|'.join(PACK_MODES)}")
    return value


@dataclass(frozen=True, kw_only=True)
class RowFormat:
    """The fields of a row (None: the usual names `text`, `prompt`/`completion`, `messages`) and the truncation."""

    text_field: str | None = None
    prompt_field: str | None = None
    answer_field: str | None = None
    truncate: str = "drop"

    def __post_init__(self) -> None:
        if self.truncate not in TRUNCATE:
            raise ConfigError(f"--truncate {self.truncate!r} is not a truncation policy",
                              hint=f"choose one of: {', '.join(TRUNCATE)}")
        if self.text_field is not None and (self.prompt_field or self.answer_field):
            raise ConfigError(f"--text-field {self.text_field!r} names plain text, --prompt-field/--answer-field "
                              "prompt/answer pairs: a row is one or the other", hint="pass one of them")

    def fields(self) -> dict[str, str | None]:
        """The field names alone (what the tokenization depends on; the truncation is applied after it)."""
        return {k: v for k, v in asdict(self).items() if k != "truncate"}


def row_kind(columns: Sequence[str], fmt: RowFormat, source: str) -> tuple[str, tuple[str, ...]]:
    """The kind of the rows of `source` (one of `KINDS`) and the fields it reads, from the fields it has; one
    ConfigError naming the fields found when a field asked for (or any usable one) is missing."""
    found = ", ".join(repr(c) for c in columns) or "none"

    def missing(flag: str, name: str) -> ConfigError:
        return ConfigError(f"{flag} {name!r} is not a field of {source}: the fields found are {found}",
                           hint=f"pass {flag} with one of them")

    if fmt.text_field is not None:
        if fmt.text_field not in columns:
            raise missing("--text-field", fmt.text_field)
        return "text", (fmt.text_field,)
    if fmt.prompt_field is not None or fmt.answer_field is not None:
        prompt, answer = fmt.prompt_field or "prompt", fmt.answer_field or "completion"
        for flag, name in (("--prompt-field", prompt), ("--answer-field", answer)):
            if name not in columns:
                raise missing(flag, name)
        return "instruction", (prompt, answer)
    if "messages" in columns:
        return "chat", ("messages",)
    if "prompt" in columns and "completion" in columns:
        return "instruction", ("prompt", "completion")
    if "text" in columns:
        return "text", ("text",)
    raise ConfigError(f"{source} has no field pipetrain knows how to train on: the fields found are {found}",
                      hint="name the text with --text-field NAME, or a prompt and its answer with --prompt-field "
                           "and --answer-field; chat rows need a 'messages' field (role/content)")

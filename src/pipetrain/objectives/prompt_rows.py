"""GRPO's settings and its data: prompt rows (`prompt` as text or chat messages, the other fields for the reward
functions), tokenized in memory, those too long for a completion in the window dropped, every `HOLD_OUT_EVERY`-th
held out; and the check that G divides the batch."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipetrain.data.cache import default_cache_root
from pipetrain.data.chat import check_known_roles
from pipetrain.data.formats import detect_format, read_rows
from pipetrain.errors import ConfigError, DataError
from pipetrain.objectives.grpo_loss import GRPOLossSettings
from pipetrain.workloads.lm.corpus import HOLD_OUT_EVERY

__all__ = ["GRPOSettings", "PromptRows", "check_generations", "read_prompt_rows"]


@dataclass(frozen=True, kw_only=True)
class GRPOSettings:
    """`rewards` (import paths), `generations` G per prompt, `iterations` optimizer steps per generation batch,
    `max_completion_length` new tokens, `top_p`, the loss (`GRPOLossSettings`, its temperature the sampling's)."""

    rewards: tuple[str, ...] = ()
    generations: int = 8
    iterations: int = 1
    max_completion_length: int = 64
    top_p: float = 1.0
    loss: GRPOLossSettings = field(default_factory=GRPOLossSettings)

    def __post_init__(self) -> None:
        if not self.rewards:
            raise ConfigError("--objective grpo needs a reward function", hint="pass --reward MODULE:FUNCTION")
        for name, value, least in (("--num-generations", self.generations, 2),
                                   ("--grpo-iterations", self.iterations, 1),
                                   ("--max-completion-length", self.max_completion_length, 1)):
            if value < least:
                raise ConfigError(f"{name} {value} is below {least}", hint=f"pass {name} {least} or more")


def check_generations(batch_size: int, generations: int, dp: int) -> None:
    """One ConfigError unless `generations` G divides the batch of completions, and its prompts the replicas."""
    if batch_size % generations:
        raise ConfigError(f"--num-generations {generations} does not divide --batch-size {batch_size} (completions "
                          "per step): a prompt's group of completions must be whole",
                          hint=f"pass --batch-size {generations * max(1, batch_size // generations)}")
    if (batch_size // generations) % dp:
        raise ConfigError(f"--batch-size {batch_size} holds {batch_size // generations} prompt(s) of {generations} "
                          f"completions, which {dp} replicas do not share evenly",
                          hint=f"pass --batch-size {generations * dp * max(1, batch_size // generations // dp)}")


@dataclass
class PromptRows:
    """One split of prompt rows: `prompts` as given, their token `ids`, each row's other `fields`, its data `rows`;
    its length counts completion slots (prompts x G x iterations): what the loop's data position counts."""

    prompts: list
    ids: list[list[int]]
    fields: list[dict]
    rows: list[int]
    slots: int
    source: str
    synthetic: bool = False

    def __len__(self) -> int:
        return len(self.ids) * self.slots


def _encode(tokenizer: Any, prompt: Any, index: int, source: str) -> list[int]:
    if isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt):
        check_known_roles(tokenizer, [m["role"] for m in prompt], index, source)
        return list(tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True,
                                                  return_dict=True)["input_ids"])
    if not isinstance(prompt, str) or not prompt.strip():
        raise DataError(f"row {index + 1} of {source}: 'prompt' is {type(prompt).__name__} {prompt!r:.40}, not text or "
                        "chat messages", hint="give every row a prompt")
    return list(tokenizer(text=prompt)["input_ids"])


def read_prompt_rows(path: Path, tokenizer: Any, *, seq_len: int,
                     settings: GRPOSettings) -> tuple[PromptRows, PromptRows]:
    """Train and held-out prompt rows of `path` (JSON lines, Parquet, a datasets folder), each prompt short enough
    for `settings.max_completion_length` new tokens within `seq_len + 1`."""
    fmt, files = detect_format(path)
    source = f"--data {str(path)!r}"
    if fmt == "text":
        raise ConfigError(f"{source} is plain text; --objective grpo reads prompt rows",
                          hint="pass JSON lines, Parquet or a datasets folder of rows with a 'prompt' field")
    rows = read_rows(fmt, files, cache_dir=default_cache_root() / "rows")
    if "prompt" not in rows.column_names:
        raise ConfigError(f"{source} has no 'prompt' field: the fields found are "
                          f"{', '.join(map(repr, rows.column_names))}", hint="give each row a 'prompt'")
    room = seq_len + 1 - settings.max_completion_length
    if room < 1:
        raise ConfigError(f"--max-completion-length {settings.max_completion_length} leaves no room for a "
                          f"prompt in the window of {seq_len} tokens",
                          hint=f"pass --seq-len {settings.max_completion_length + 32} or more")
    kept, dropped = [], 0
    for index, row in enumerate(rows):
        ids = _encode(tokenizer, row["prompt"], index, source)
        if len(ids) > room:
            dropped += 1
            continue
        kept.append((index, row["prompt"], ids, {k: v for k, v in row.items() if k != "prompt"}))
    if len(kept) < HOLD_OUT_EVERY:
        raise DataError(f"{source} gives {len(kept)} prompt(s) within {room} tokens ({dropped} longer dropped); a "
                        f"train and a held-out split need {HOLD_OUT_EVERY}", hint="give more prompts")
    slots = settings.generations * settings.iterations
    how = f"prompts of {fmt} at {path} ({len(rows):,} rows, {dropped} longer than {room} tokens dropped)"

    def split(part: list, name: str) -> PromptRows:
        return PromptRows([p for _, p, _, _ in part], [i for _, _, i, _ in part], [f for *_, f in part],
                          [r for r, *_ in part], slots, f"{how}, {name} split ({len(part):,} prompts)")

    held = [k for n, k in enumerate(kept) if n % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1]
    return split([k for n, k in enumerate(kept) if n % HOLD_OUT_EVERY != HOLD_OUT_EVERY - 1], "train"), \
        split(held, "held-out")

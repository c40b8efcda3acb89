"""Preference rows in TRL's format as pairs of token rows: what `--objective dpo` trains on.

A row holds `prompt`, `chosen` and `rejected` (TRL's explicit-prompt format): plain text, the answers tokenized
after the prompt with an EOS appended (as TRL's `DPOTrainer` does: `tokenizer(prompt)` and `tokenizer(prompt +
answer + eos)`, the answer being the tokens after the prompt's); or chat messages, the prompt rendered with the
model's own chat template and its generation prompt, each answer as the rest of the rendering of the prompt and
that answer. A chat row without `prompt` (TRL's implicit prompt) holds two whole conversations that must differ in
their last (assistant) turn alone. Only answer tokens train. A pair longer than the window is dropped; every
`HOLD_OUT_EVERY`-th pair is held out. The pairs are tokenized in memory (not cached).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipetrain.data.cache import default_cache_root
from pipetrain.data.chat import check_known_roles
from pipetrain.data.formats import detect_format, read_rows
from pipetrain.errors import ConfigError, DataError
from pipetrain.objectives.columns import with_columns
from pipetrain.pipeline.loss import IGNORE_INDEX
from pipetrain.workloads.lm.corpus import HOLD_OUT_EVERY
from pipetrain.workloads.position import replica_shares
from pipetrain.workloads.text.batching import batch_order, num_batches

__all__ = ["PreferencePairs", "read_pairs", "pair_ids", "pair_batches", "pair_count"]


@dataclass
class PreferencePairs:
    """One split of pairs: `tokens` `[N, 2, width]` (chosen, rejected; padded), `trained` the answer tokens,
    `lengths` `[N, 2]`, `reference` `[N, 2]` the reference model's answer log-probabilities (float64; NaN until
    `objectives.reference` computes them; unused by a reference-free loss), `rows` the row of each pair."""

    tokens: torch.Tensor
    trained: torch.Tensor
    lengths: torch.Tensor
    rows: torch.Tensor
    pad_id: int
    source: str
    reference: torch.Tensor | None = None
    synthetic: bool = False

    def __post_init__(self) -> None:
        if self.reference is None:
            self.reference = torch.full(self.lengths.shape, float("nan"), dtype=torch.float64)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def take(self, part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pairs `part` as `(input ids [2n, seq], targets [2n, seq + 1])`, rows interleaved chosen, rejected: the
        targets are the next tokens of the answers (`IGNORE_INDEX` elsewhere) and the reference column."""
        tokens = self.tokens[part].flatten(0, 1)
        labels = tokens[:, 1:].clone()
        labels[~self.trained[part].flatten(0, 1)[:, 1:]] = IGNORE_INDEX
        return tokens[:, :-1], with_columns(labels, self.reference[part].flatten())

    def sequences(self, part: torch.Tensor) -> torch.Tensor:
        """Pairs `part`'s token ids `[2n, width]`, interleaved chosen, rejected (for `data show`)."""
        return self.tokens[part].flatten(0, 1)


def _is_chat(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value)


def _text(value: Any, field: str, index: int, source: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"row {index + 1} of {source}: {field!r} is {type(value).__name__} {value!r:.60}, not text or "
                        "chat messages", hint="write each row as TRL's preference format: prompt, chosen, rejected")
    return value


def pair_ids(row: dict, index: int, tokenizer: Any, source: str) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, chosen answer ids, rejected answer ids) of preference row `index` (see the module docstring)."""
    prompt, chosen, rejected = row.get("prompt"), row.get("chosen"), row.get("rejected")
    for name, value in (("chosen", chosen), ("rejected", rejected)):
        if value is None or (isinstance(value, str) and not value.strip()) or value == [] or (
                _is_chat(value) and not any(str(m.get("content") or "").strip() for m in value
                                            if m.get("role") == "assistant")):
            raise DataError(f"row {index + 1} of {source}: the {name} answer is empty",
                            hint="every pair needs a non-empty chosen and rejected answer: fix or remove the row")
    if prompt is None and _is_chat(chosen) and _is_chat(rejected):  # TRL's implicit prompt
        if chosen[:-1] != rejected[:-1] or not chosen[:-1]:
            raise DataError(f"row {index + 1} of {source}: chosen and rejected have different prompts (their turns "
                            "before the last differ)", hint="a pair answers one prompt: give both conversations the "
                                                            "same turns before their last answer, or a 'prompt' field")
        prompt, chosen, rejected = chosen[:-1], chosen[-1:], rejected[-1:]
    if prompt is None:
        raise DataError(f"row {index + 1} of {source} has no 'prompt'", hint="write each row as TRL's preference "
                                                                        "format: prompt, chosen, rejected")
    if _is_chat(prompt):
        if not (_is_chat(chosen) and _is_chat(rejected)):
            raise DataError(f"row {index + 1} of {source}: the prompt is chat messages, the answers are not",
                            hint="give chosen and rejected as lists of assistant messages too")
        for name, answer in (("chosen", chosen), ("rejected", rejected)):
            roles = sorted({str(m.get("role")) for m in answer} - {"assistant"})
            if roles:
                raise DataError(f"row {index + 1} of {source}: {name} holds {', '.join(map(repr, roles))} turns beside "
                                "its 'prompt'", hint="with a 'prompt' field, chosen and rejected are the assistant's "
                                                     "answer alone: drop their prompt turns, or drop 'prompt'")
        check_known_roles(tokenizer, [m["role"] for m in (*prompt, *chosen, *rejected)], index, source)
        render = tokenizer.apply_chat_template
        head = render(prompt, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
        whole = [render(prompt + answer, tokenize=True, return_dict=True)["input_ids"] for answer in (chosen, rejected)]
    else:
        eos = tokenizer.eos_token or ""
        prompt = _text(prompt, "prompt", index, source)
        answers = [_text(a, name, index, source) for a, name in ((chosen, "chosen"), (rejected, "rejected"))]
        head = tokenizer(text=prompt)["input_ids"]
        whole = [tokenizer(text=prompt + (a if a.endswith(eos) else a + eos))["input_ids"] for a in answers]
    if not head:
        raise DataError(f"row {index + 1} of {source}: the prompt is empty", hint="give every pair a prompt")
    return list(head), list(whole[0][len(head):]), list(whole[1][len(head):])


def read_pairs(path: Path, tokenizer: Any, *, seq_len: int, pad_id: int,
               hold_out_every: int = HOLD_OUT_EVERY) -> tuple[PreferencePairs, PreferencePairs]:
    """Train and held-out pairs of the preference rows at `path` (JSON lines, Parquet, a datasets folder), each
    sequence at most `seq_len + 1` tokens (longer pairs dropped)."""
    fmt, files = detect_format(path)
    source = f"--data {str(path)!r}"
    if fmt == "text":
        raise ConfigError(f"{source} is plain text; --objective dpo reads preference rows",
                          hint="pass JSON lines, Parquet or a datasets folder of prompt/chosen/rejected rows")
    rows = read_rows(fmt, files, cache_dir=default_cache_root() / "rows")
    missing = [name for name in ("chosen", "rejected") if name not in rows.column_names]
    if missing:
        raise ConfigError(f"{source} has no {' and no '.join(repr(m) for m in missing)} field: the fields found are "
                          f"{', '.join(map(repr, rows.column_names))}",
                          hint="--objective dpo reads TRL's preference format: prompt, chosen, rejected")
    width, kept, dropped = seq_len + 1, [], 0
    for index, row in enumerate(rows):
        head, chosen, rejected = pair_ids(row, index, tokenizer, source)
        if len(head) + max(len(chosen), len(rejected)) > width:
            dropped += 1
            continue
        kept.append((index, head, chosen, rejected))
    if len(kept) < hold_out_every:
        raise DataError(f"{source} gives {len(kept)} pair(s) within {width} tokens ({dropped} longer dropped); a "
                        f"train and a held-out split need {hold_out_every}",
                        hint="give more pairs or a longer --seq-len")
    tokens = torch.full((len(kept), 2, width), pad_id, dtype=torch.long)
    trained = torch.zeros((len(kept), 2, width), dtype=torch.bool)
    lengths = torch.zeros((len(kept), 2), dtype=torch.long)
    for i, (_, head, chosen, rejected) in enumerate(kept):
        for j, answer in enumerate((chosen, rejected)):
            ids = head + answer
            tokens[i, j, : len(ids)] = torch.tensor(ids)
            trained[i, j, len(head): len(ids)] = True
            lengths[i, j] = len(ids)
    every = torch.arange(len(kept))
    held = every % hold_out_every == hold_out_every - 1
    test, train = every[held], every[~held]
    row_of = torch.tensor([index for index, *_ in kept])
    how = f"preference pairs of {fmt} at {path} ({len(rows):,} rows, {dropped} longer than {width} tokens dropped)"

    def split(part: torch.Tensor, name: str) -> PreferencePairs:
        return PreferencePairs(tokens[part], trained[part], lengths[part], row_of[part], pad_id,
                               f"{how}, {name} split ({len(part):,} pairs)")

    return split(train, "train"), split(test, "held-out")


def pair_count(pairs: PreferencePairs, batch_size: int, *, replicas: int, drop_last: bool = True) -> int:
    """Global batches of `batch_size` pairs an epoch has (training drops a last short batch: a pair per
    micro-batch needs full ones)."""
    return num_batches(len(pairs), batch_size, replicas=replicas, drop_last=drop_last)


def pair_batches(pairs: PreferencePairs, batch_size: int, *, shuffle: bool, seed: int, epoch: int, replica: int,
                 replicas: int, start: int = 0, drop_last: bool = True,
                 indices: bool = False) -> Iterator[Any]:
    """One epoch of this replica's `(input ids, targets)` (see `PreferencePairs.take`), global batches of
    `batch_size` pairs from global pair `start` on; with `indices`, `(pair indices, (input ids, targets))`."""
    order = batch_order(pairs.lengths.max(dim=1).values, batch_size, shuffle=shuffle, bucket=False, seed=seed,
                        stream=f"dpo-epoch-{epoch}", bucket_stream=f"dpo-buckets-{epoch}")
    for _, part in replica_shares(order, batch_size, replica=replica, replicas=replicas, start=start,
                                  drop_last=drop_last):
        batch = pairs.take(part)
        yield (part, batch) if indices else batch

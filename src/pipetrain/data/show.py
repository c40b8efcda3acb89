"""Samples as the model sees them, the tokens that train marked: what `pipetrain data show` prints, so a user checks
the chat template and the answer-only labels before spending a GPU-hour."""

from __future__ import annotations

from typing import Any

import torch

from pipetrain.data.packing import PackedDocuments

__all__ = ["OPEN", "CLOSE", "marked", "show_samples"]

#: around each run of tokens that train (a target of the loss)
OPEN, CLOSE = "[[", "]]"


def marked(tokenizer: Any, ids: list[int], trains: list[bool]) -> str:
    """`ids` decoded run by run, the runs that train between `OPEN` and `CLOSE`."""
    out, start = [], 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or trains[end] != trains[start]:
            text = tokenizer.decode(ids[start:end])
            out.append(f"{OPEN}{text}{CLOSE}" if trains[start] else text)
            start = end
    return "".join(out)


def show_samples(split: Any, tokenizer: Any, count: int) -> str:
    """The first `count` samples of `split` (a `TokenRows`, `TokenWindows` or `PackedDocuments`), decoded, the
    tokens that train (are the target of the token before them) marked, each under a line with its token counts."""
    count = min(count, len(split))
    if isinstance(split, PackedDocuments):
        return _show_packed(split, tokenizer, count)
    tokens, trained = split.take(torch.arange(count))
    lines = [f"{split.source}", f"first {count} sample(s); tokens the loss trains on are between {OPEN} and {CLOSE}"]
    for i in range(count):
        length = int(split.lengths[i])
        ids = tokens[i, :length].tolist()
        trains = [False] + ([True] * (length - 1) if trained is None else trained[i, 1:length].tolist())
        where = f"window {int(split.index[i])}" if split.packed and hasattr(split, "index") else f"sample {i}"
        lines += ["", f"--- {where}: {length} tokens, {sum(trains)} trained ---", marked(tokenizer, ids, trains)]
    return "\n".join(lines)


def _show_packed(split: PackedDocuments, tokenizer: Any, count: int) -> str:
    """The first `count` windows of documents packed by `pipetrain.data.packing`, each document on its own line
    (positions restart there; it attends to itself only), trained tokens marked."""
    lines = [f"{split.source}", f"first {count} window(s) of {split.seq_len} tokens, one document a line; tokens "
                                f"the loss trains on are between {OPEN} and {CLOSE}"]
    for w in range(count):
        members = split.members[int(split.bounds[w]) : int(split.bounds[w + 1])]
        tokens, trained = split.documents.take(members)
        lengths = split.documents.lengths[members].tolist()
        lines += ["", f"--- window {w}: {len(members)} document(s), {int(split.lengths[w])} of {split.seq_len} "
                      f"slots filled ---"]
        for j, length in enumerate(lengths):
            ids = tokens[j, :length].tolist()
            trains = [False] + ([True] * (length - 1) if trained is None else trained[j, 1:length].tolist())
            lines.append(f"| {marked(tokenizer, ids, trains)}")
    return "\n".join(lines)

"""Preference pairs as the model sees them (`pipetrain data show --objective dpo`): the prompt once, then each answer
with the tokens the loss trains on marked, so a user checks the template and the answer-only labels first."""

from __future__ import annotations

from typing import Any

from pipetrain.data.show import CLOSE, OPEN, marked
from pipetrain.objectives.pairs import PreferencePairs

__all__ = ["show_pairs"]


def show_pairs(pairs: PreferencePairs, tokenizer: Any, count: int) -> str:
    """The first `count` pairs of `pairs`, decoded: each sequence whole, the answer tokens (those that train, the
    target of the token before them) between `OPEN` and `CLOSE`, under a line with their token counts."""
    count = min(count, len(pairs))
    lines = [pairs.source, f"first {count} pair(s), rows as the pipeline sees them (chosen, then rejected); tokens "
                           f"the loss trains on are between {OPEN} and {CLOSE}"]
    for i in range(count):
        lines += ["", f"--- pair {i} (row {int(pairs.rows[i]) + 1}) ---"]
        for j, name in enumerate(("chosen", "rejected")):
            length = int(pairs.lengths[i, j])
            ids = pairs.tokens[i, j, :length].tolist()
            trains = pairs.trained[i, j, :length].tolist()
            lines.append(f"{name} ({length} tokens, {sum(trains)} trained): {marked(tokenizer, ids, trains)}")
    return "\n".join(lines)

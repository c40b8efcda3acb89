"""The user's reward functions (`--reward MODULE:FUNCTION`, several allowed) called as TRL calls them, checked.

A reward function takes `prompts`, `completions` and `completion_ids` (lists, one entry per completion) and the
row's other fields as keyword lists (TRL's signature; accept `**kwargs`), and returns one float per completion
(None: unscored, NaN as in TRL). A function that raises is called again one completion at a time to name the row
that breaks it (with the exception's first line); a wrong number of results, or a result that is not a number or
not finite (NaN: return None to leave a completion unscored), is named with the function and the rows. Every
message is one ConfigError (exit 2).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pipetrain.errors import ConfigError
from pipetrain.workloads.loader import load_object

__all__ = ["RewardFunction", "load_rewards", "score"]


class RewardFunction:
    """One reward function and the import path that named it."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.fn: Callable[..., Sequence[Any]] = load_object(spec, "--reward")
        if not callable(self.fn):
            raise ConfigError(f"--reward {spec!r} is a {type(self.fn).__name__}, not a function",
                              hint="name a function f(prompts, completions, **kwargs) -> list of floats")
        self.name = getattr(self.fn, "__name__", spec)

    def _call(self, prompts: list, completions: list, ids: list, fields: dict[str, list]) -> Sequence[Any]:
        return self.fn(prompts=prompts, completions=completions, completion_ids=ids, **fields)

    def __call__(self, prompts: list, completions: list, ids: list, fields: dict[str, list],
                 rows: list[int]) -> torch.Tensor:
        """The rewards of the completions (float32, NaN for None); `rows` are their data rows (from 0;
        messages number them from 1, as an editor numbers lines)."""
        try:
            out = list(self._call(prompts, completions, ids, fields))
        except Exception as err:  # find the row: one completion at a time
            row = rows[0]
            for i in range(len(prompts)):
                try:
                    self._call(prompts[i:i + 1], completions[i:i + 1], ids[i:i + 1],
                               {k: v[i:i + 1] for k, v in fields.items()})
                except Exception:
                    row = rows[i]
                    break
            said = (str(err).strip().splitlines() or [""])[0]  # one line: the exception's first
            raise ConfigError(f"--reward {self.spec!r}: {self.name} raised {type(err).__name__}: {said} on row "
                              f"{row + 1}",
                              hint=f"fix {self.name} for that row (it gets prompts, completions, completion_ids and "
                                   f"the row's fields {sorted(fields)} as keyword lists)") from None
        if len(out) != len(prompts):
            raise ConfigError(f"--reward {self.spec!r}: {self.name} returned {len(out)} reward(s) for {len(prompts)} "
                              f"completions (rows {min(rows) + 1}..{max(rows) + 1})",
                              hint="return exactly one float per completion")
        values = []
        for i, value in enumerate(out):
            if value is None:
                values.append(math.nan)
            elif isinstance(value, (int, float)) and not isinstance(value, bool) or hasattr(value, "__float__"):
                if not math.isfinite(float(value)):
                    raise ConfigError(f"--reward {self.spec!r}: {self.name} returned {float(value)} for row "
                                      f"{rows[i] + 1}",
                                      hint="return a finite float, or None for a completion it does not score")
                values.append(float(value))
            else:
                raise ConfigError(f"--reward {self.spec!r}: {self.name} returned {type(value).__name__} {value!r:.40} "
                                  f"for row {rows[i] + 1}, not a number",
                                  hint="return one float (or None) per completion")
        return torch.tensor(values, dtype=torch.float32)


def load_rewards(specs: Sequence[str]) -> list[RewardFunction]:
    """The reward functions `specs` names (`MODULE:FUNCTION` or `file.py:FUNCTION`), loaded now."""
    if not specs:
        raise ConfigError("--objective grpo needs a reward function", hint="pass --reward MODULE:FUNCTION")
    return [RewardFunction(spec) for spec in specs]


def score(functions: Sequence[RewardFunction], prompts: list, completions: list, ids: list,
          fields: dict[str, list], rows: list[int], weights: Sequence[float] | None = None) -> tuple[torch.Tensor,
                                                                                                   torch.Tensor]:
    """(each function's rewards `[n, k]`, their weighted sum `[n]`; NaN where every function said None), as TRL's
    `sum_then_normalize`."""
    per = torch.stack([f(prompts, completions, ids, fields, rows) for f in functions], dim=1)
    w = torch.tensor(list(weights) if weights else [1.0] * len(functions), dtype=torch.float32)
    total = (per * w).nansum(dim=1)
    total[torch.isnan(per).all(dim=1)] = math.nan
    return per, total

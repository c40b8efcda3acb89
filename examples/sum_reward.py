"""Rewards for GRPO on examples/sum_prompts.py's additions (TRL's reward signature; they add up when both are given):
`exact`, 1 when the completion, normalised as `pipetrain eval` normalises answers, is the row's `answer`; `number`,
0.25 when the completion is a whole number alone (the format the question asks for, right or wrong).

    --reward examples/sum_reward.py:exact --reward examples/sum_reward.py:number
"""

from __future__ import annotations

from pipetrain.evaluate.answers import normalize


def _texts(completions: list) -> list[str]:
    return [c[-1]["content"] if isinstance(c, list) else c for c in completions]  # chat or plain completions


def exact(prompts: list, completions: list, answer: list[str], **fields: list) -> list[float]:
    return [float(normalize(t) == normalize(a)) for t, a in zip(_texts(completions), answer)]


def number(prompts: list, completions: list, **fields: list) -> list[float]:
    return [0.25 if t.strip().isdigit() else 0.0 for t in _texts(completions)]

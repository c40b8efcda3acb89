"""Choosing the next token and knowing when to stop: greedy, temperature / top-p sampling, EOS and length.

Pure functions of logits, no process group: the pipeline's last stage calls `next_tokens` once per step and
`Stopping` keeps which sequences are finished, as transformers' `generate` does (`_sample`): the logits in float32,
transformers' own logits warpers (`TemperatureLogitsWarper`, `TopPLogitsWarper`), `torch.multinomial` on their
softmax, or the argmax when greedy; a finished sequence's next token is the pad token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipetrain.errors import ConfigError
from pipetrain.workloads.hf.families import require_transformers

__all__ = ["Sampling", "next_tokens", "Stopping"]


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: `temperature` 0 is greedy (the argmax); above 0, sampled from the softmax of
    the logits divided by it, over the smallest set of tokens whose probability reaches `top_p` (1: all), with a
    generator seeded by `seed` (the same draws on every run)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ConfigError(f"--temperature {self.temperature} is negative",
                              hint="pass 0 for greedy decoding, or a positive value (e.g. 0.7) to sample")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"--top-p {self.top_p} is outside (0, 1]",
                              hint="pass a probability mass such as 0.9 (1: no top-p filtering)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        """The seeded generator of the draws (None when greedy)."""
        return None if self.greedy else torch.Generator(device=device).manual_seed(self.seed)

    def processors(self) -> list:
        """transformers' logits warpers for this sampling (empty when greedy)."""
        if self.greedy:
            return []
        process = require_transformers().generation.logits_process
        warpers = [] if self.temperature == 1.0 else [process.TemperatureLogitsWarper(self.temperature)]
        return warpers + ([] if self.top_p == 1.0 else [process.TopPLogitsWarper(self.top_p)])


def next_tokens(logits: torch.Tensor, sampling: Sampling, sequences: torch.Tensor,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token of each row of `logits` (`[batch, vocab]`, the last position's), chosen as `sampling` says;
    `sequences` (`[batch, tokens so far]`) is what transformers' warpers are given."""
    scores = logits.to(dtype=torch.float32, copy=True)
    if sampling.greedy:
        return scores.argmax(dim=-1)
    for warper in sampling.processors():
        scores = warper(sequences, scores)
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)


class Stopping:
    """Which of `batch` sequences are finished: a sequence ends at its first EOS token (any of `eos`), the batch at
    `max_new_tokens` new tokens or when every sequence has ended. A finished sequence's later tokens are `pad`."""

    def __init__(self, batch: int, *, eos: list[int] | int | None, pad: int | None, max_new_tokens: int,
                 device: torch.device | str = "cpu") -> None:
        if max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens {max_new_tokens} is not positive", hint="pass a count such as 32")
        eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self.eos = torch.tensor(eos_ids, dtype=torch.long, device=device)
        self.pad = pad if pad is not None else (eos_ids[0] if eos_ids else 0)
        self.max_new_tokens, self.steps = max_new_tokens, 0
        self.unfinished = torch.ones(batch, dtype=torch.bool, device=device)

    def mask(self, tokens: torch.Tensor) -> torch.Tensor:
        """`tokens` with the pad token in the rows already finished."""
        return torch.where(self.unfinished, tokens, torch.full_like(tokens, self.pad))

    def update(self, tokens: torch.Tensor) -> bool:
        """Record this step's (masked) tokens; True when generation is over."""
        self.steps += 1
        if self.eos.numel():
            self.unfinished &= ~torch.isin(tokens, self.eos)
        return self.steps >= self.max_new_tokens or not bool(self.unfinished.any())

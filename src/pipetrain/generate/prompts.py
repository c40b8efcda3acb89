"""Prompts as the model reads them: tokenized by the model folder's tokenizer (its chat template with `chat`),
left-padded into one batch with an attention mask and position ids, as transformers' `generate` prepares them,
and checked against the model's context before any rank starts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipetrain.errors import ConfigError

__all__ = ["PromptBatch", "read_prompts", "encode_prompts", "left_pad", "check_context"]


@dataclass(frozen=True)
class PromptBatch:
    """Left-padded token ids `[batch, longest]`, their attention mask (0 at padding) and position ids (the
    attention mask's cumulative sum minus one, 0 at padding, as `generate` computes them)."""

    ids: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor

    @property
    def lengths(self) -> list[int]:
        return self.mask.sum(dim=1).tolist()


def left_pad(sequences: list[list[int]], pad: int) -> PromptBatch:
    """One batch of token id lists, padded on the left with `pad`."""
    if not sequences or any(not ids for ids in sequences):
        raise ConfigError("a prompt is empty", hint="pass prompts with at least one token")
    longest = max(len(ids) for ids in sequences)
    ids = torch.tensor([[pad] * (longest - len(s)) + list(s) for s in sequences], dtype=torch.long)
    mask = torch.tensor([[0] * (longest - len(s)) + [1] * len(s) for s in sequences], dtype=torch.long)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    return PromptBatch(ids, mask, positions)


def read_prompts(prompt: str | None, prompts_file: str | Path | None) -> list[str]:
    """The prompts of `--prompt TEXT` or `--prompts FILE` (one prompt a line, blank lines skipped)."""
    if (prompt is None) == (prompts_file is None):
        raise ConfigError("generate needs exactly one of --prompt TEXT and --prompts FILE"
                          + (" (both were given)" if prompt is not None else ""),
                          hint="pass --prompt 'Once upon a time' or --prompts prompts.txt (one prompt a line)")
    if prompt is not None:
        return [prompt]
    path = Path(prompts_file)
    if not path.is_file():
        raise ConfigError(f"--prompts {str(path)!r} is not a file", hint="pass a text file with one prompt a line")
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    texts = [line for line in lines if line]
    if not texts:
        raise ConfigError(f"--prompts {str(path)!r} holds no prompt", hint="write one prompt a line")
    return texts


def encode_prompts(tokenizer: Any, texts: list[str], *, chat: bool = False) -> list[list[int]]:
    """Each text's token ids: as the tokenizer encodes it (special tokens included), or with `chat` the
    tokenizer's chat template of one user message and the assistant's turn to answer."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("--chat needs the tokenizer's chat template, and this model folder's tokenizer has none",
                              hint="drop --chat, or pass a chat model's folder (e.g. an -Instruct model)")
        encoded = []
        for text in texts:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
            encoded.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
        return encoded
    return [list(tokenizer(text)["input_ids"]) for text in texts]


def check_context(lengths: list[int], max_new_tokens: int, context: int) -> None:
    """One ConfigError when the longest prompt and the new tokens do not fit in the model's context."""
    longest = max(lengths)
    if longest + max_new_tokens > context:
        which = lengths.index(longest) + 1
        raise ConfigError(f"prompt {which} is {longest} tokens long and --max-new-tokens is {max_new_tokens}: "
                          f"{longest + max_new_tokens} tokens, longer than the model's context of {context} tokens",
                          hint=f"shorten the prompt, or pass --max-new-tokens {max(context - longest, 0)} or fewer"
                          if longest < context else f"shorten prompt {which} to under {context} tokens")

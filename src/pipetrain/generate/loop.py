"""The generation loop of one rank: prefill, then one token per step, the activations sent stage to stage.

Rank r of a pp × tp job runs stage r // tp (its tensor-parallel rank r % tp). Each step, the first stage embeds
the new tokens, every stage runs its layers against its own key/value cache and sends the hidden states to the
same tensor-parallel rank of the next stage (plain `torch.distributed` send/recv: one boundary hop per stage and
step), and the last stage computes the last position's logits and picks the next tokens, which its first
tensor-parallel rank broadcasts to every rank: every rank then knows the tokens, when to stop, and the next step's
inputs. The shapes are known everywhere (batch, new tokens, hidden size), so nothing else crosses.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipetrain.errors import ConfigError
from pipetrain.generate.prompts import PromptBatch
from pipetrain.generate.sampling import Sampling, Stopping, next_tokens
from pipetrain.generate.stage import GenerationStage
from pipetrain.partition import balance_bounds, uniform_balance

__all__ = ["Placement", "Generated", "generate_tokens", "stage_blocks"]


@dataclass(frozen=True)
class Placement:
    """Where this rank sits in a pp × tp generation job of the global ranks `first .. first + pp * tp - 1`
    (`rank = first + stage * tp + tp_rank`)."""

    rank: int
    pp: int
    tp: int = 1
    first: int = 0

    @property
    def stage(self) -> int:
        return (self.rank - self.first) // self.tp

    @property
    def prev_rank(self) -> int | None:
        return None if self.stage == 0 else self.rank - self.tp

    @property
    def next_rank(self) -> int | None:
        return None if self.stage == self.pp - 1 else self.rank + self.tp

    @property
    def sampler(self) -> int:
        """The rank that picks the tokens and broadcasts them: the last stage's first tensor-parallel rank."""
        return self.first + (self.pp - 1) * self.tp


def stage_blocks(num_blocks: int, pp: int, stage: int) -> range:
    """The blocks of `stage` when `num_blocks` are split into `pp` stages as evenly as they go."""
    if pp > num_blocks:
        raise ConfigError(f"--pp {pp} is more stages than the model's {num_blocks} blocks (embedding, "
                          f"{num_blocks - 2} layers, head)", hint=f"pass --pp {num_blocks} or fewer")
    return range(*balance_bounds(uniform_balance(num_blocks, pp))[stage])


@dataclass(frozen=True)
class Generated:
    """The new tokens of every prompt (`[batch, steps]`, the pad token after a sequence's EOS) and the seconds
    the loop took (prefill included)."""

    tokens: torch.Tensor
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens.numel() / self.seconds if self.seconds > 0 else float("inf")


def _hop(stage: GenerationStage, where: Placement, inputs: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
         hidden_size: int, dtype: torch.dtype) -> torch.Tensor | None:
    """This rank's part of one step: receive, run the stage, send (the logits on the last stage, else None)."""
    if where.prev_rank is not None:
        inputs = torch.empty(*inputs.shape, hidden_size, dtype=dtype, device=inputs.device)
        dist.recv(inputs, src=where.prev_rank)
    out = stage.forward(inputs, mask, positions)
    if where.next_rank is not None:
        dist.send(out.contiguous(), dst=where.next_rank)
        return None
    return out


def generate_tokens(stage: GenerationStage, where: Placement, batch: PromptBatch, sampling: Sampling,
                    stopping: Stopping, *, hidden_size: int, dtype: torch.dtype = torch.float32,
                    group: dist.ProcessGroup | None = None) -> Generated:
    """Generate for `batch` on every rank of the job (a collective call over `group`, the job's ranks; None: the
    whole world); `stopping` ends it. With one rank (pp = tp = 1) no process group is needed."""
    device = stage.blocks[0].parameters().__next__().device
    ids, mask, positions = batch.ids.to(device), batch.mask.to(device), batch.positions.to(device)
    sequences, inputs = ids, ids
    generator = sampling.generator(device) if where.rank == where.sampler else None
    new: list[torch.Tensor] = []
    stage.reset()
    several = where.pp * where.tp > 1
    if several:
        dist.barrier(group=group)
    start = time.perf_counter()
    while True:
        logits = _hop(stage, where, inputs, mask, positions, hidden_size, dtype)
        if logits is not None and where.rank == where.sampler:
            chosen = stopping.mask(next_tokens(logits, sampling, sequences, generator))
        else:
            chosen = torch.empty(ids.shape[0], dtype=torch.long, device=device)
        if several:
            dist.broadcast(chosen, src=where.sampler, group=group)
        new.append(chosen)
        sequences = torch.cat([sequences, chosen[:, None]], dim=1)
        if stopping.update(chosen):
            break
        inputs = chosen[:, None]
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        positions = positions[:, -1:] + 1
    seconds = time.perf_counter() - start
    return Generated(torch.stack(new, dim=1).cpu(), seconds)

"""The generation loop of one rank: prefill, then one token per step, the activations sent stage to stage.

Rank r of a pp × tp job runs stage r // tp (its tensor-parallel rank r % tp). Each step, the first stage embeds
the new tokens, every stage runs its layers against its own key/value cache and sends the hidden states to the
same tensor-parallel rank of the next stage (plain `torch.distributed` send/recv: one boundary hop per stage and
step), and the last stage computes the last position's logits and picks the next tokens, which its first
tensor-parallel rank broadcasts to every rank: every rank then knows the tokens, when to stop, and the next step's
inputs. The shapes are known everywhere (batch, new tokens, hidden size), so nothing else crosses. A rank holding
several stages (a training engine's interleaved or V stages) runs them in stage order, passing the hidden states
in memory where two consecutive stages are its own.

Expert parallelism (`--ep`): the replicas of an expert-parallel group exchange tokens at every MoE layer, so they
must run as many steps. With `Route.lockstep` (that group) a replica whose sequences ended goes on stepping (its
extra tokens discarded) until every replica of the group has ended: one all-reduce per step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.errors import ConfigError
from pipetrain.generate.prompts import PromptBatch
from pipetrain.generate.sampling import Sampling, Stopping, next_tokens
from pipetrain.generate.stage import GenerationStage
from pipetrain.partition import balance_bounds, uniform_balance

__all__ = ["Route", "Placement", "Generated", "generate_tokens", "stage_blocks"]


@dataclass(frozen=True)
class Route:
    """Who runs what in one pipeline of a generation: `owners[k]` is the global rank running stage k (the ranks of
    this rank's tensor-parallel position), `sampler` the rank that picks the tokens and broadcasts them over
    `group` (the pipeline's ranks, all tensor-parallel positions; None: the whole world)."""

    rank: int
    owners: tuple[int, ...]
    sampler: int
    group: Any = None

    @property
    def ranks(self) -> int:
        """How many ranks the pipeline spans (1: no process group is needed)."""
        return len(set(self.owners)) * max(1, self.tp)

    tp: int = 1
    #: the ranks that must run as many steps as this one (its expert-parallel group; None: none)
    lockstep: Any = None


@dataclass(frozen=True)
class Placement:
    """Where this rank sits in a plain pp × tp generation job of the global ranks `first .. first + pp * tp - 1`
    (`rank = first + stage * tp + tp_rank`, one stage per rank)."""

    rank: int
    pp: int
    tp: int = 1
    first: int = 0

    @property
    def stage(self) -> int:
        return (self.rank - self.first) // self.tp

    def route(self, group: Any = None) -> Route:
        tp_rank = (self.rank - self.first) % self.tp
        owners = tuple(self.first + stage * self.tp + tp_rank for stage in range(self.pp))
        return Route(self.rank, owners, self.first + (self.pp - 1) * self.tp, group, self.tp)


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


def _step(stages: dict[int, GenerationStage], route: Route, inputs: torch.Tensor, mask: torch.Tensor,
          positions: torch.Tensor, hidden_size: int, dtype: torch.dtype) -> torch.Tensor | None:
    """This rank's part of one step, its stages in order: receive, run, send (the logits on the last stage)."""
    last, logits, carried = len(route.owners) - 1, None, inputs
    for k, owner in enumerate(route.owners):
        if owner != route.rank:
            continue
        if k > 0 and route.owners[k - 1] != route.rank:
            carried = torch.empty(*inputs.shape, hidden_size, dtype=dtype, device=inputs.device)
            dist.recv(carried, src=route.owners[k - 1])
        out = stages[k].forward(carried, mask, positions)
        if k == last:
            logits = out
        elif route.owners[k + 1] != route.rank:
            dist.send(out.contiguous(), dst=route.owners[k + 1])
        carried = out
    return logits


def generate_tokens(stages: dict[int, GenerationStage], route: Route, batch: PromptBatch, sampling: Sampling,
                    stopping: Stopping, *, hidden_size: int, dtype: torch.dtype = torch.float32) -> Generated:
    """Generate for `batch` on every rank of the pipeline (a collective call over `route.group`); `stopping` ends
    it. `stages`: this rank's stages by stage id. With one rank no process group is needed."""
    device = next(next(iter(stages.values())).blocks[0].parameters()).device
    ids, mask, positions = batch.ids.to(device), batch.mask.to(device), batch.positions.to(device)
    sequences, inputs = ids, ids
    generator = sampling.generator(device) if route.rank == route.sampler else None
    new: list[torch.Tensor] = []
    for stage in stages.values():
        stage.reset()
    several = route.ranks > 1
    if several:
        dist.barrier(group=route.group)
    start = time.perf_counter()
    ended: int | None = None  # the steps of this replica's own generation, once it has ended
    while True:
        logits = _step(stages, route, inputs, mask, positions, hidden_size, dtype)
        if logits is not None and route.rank == route.sampler:
            chosen = stopping.mask(next_tokens(logits, sampling, sequences, generator))
        else:
            chosen = torch.empty(ids.shape[0], dtype=torch.long, device=device)
        if several:
            dist.broadcast(chosen, src=route.sampler, group=route.group)
        new.append(chosen)
        sequences = torch.cat([sequences, chosen[:, None]], dim=1)
        if ended is None and stopping.update(chosen):
            ended = len(new)
        if _over(ended is not None, route.lockstep, device):
            break
        inputs = chosen[:, None]
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        positions = positions[:, -1:] + 1
    seconds = time.perf_counter() - start
    return Generated(torch.stack(new[:ended], dim=1).cpu(), seconds)


def _over(ended: bool, lockstep: Any, device: torch.device) -> bool:
    """Whether to stop stepping: this replica has ended and (with a `lockstep` group) so has every other."""
    if lockstep is None:
        return ended
    going = torch.tensor([0 if ended else 1], device=device)
    dist.all_reduce(going, op=dist.ReduceOp.MAX, group=lockstep)
    return not bool(going.item())

"""Generation from a training engine's own stages (`pipetrain train --sample-every`, `pipetrain eval`): the blocks
each rank already holds, wrapped or sharded as they train, generate without a second copy of the model.

The engine's stage modules (`BlockSequential` inside recomputation, autocast, DDP or FSDP2 wrappers) give each
stage's blocks; FSDP2-sharded blocks are gathered (`unshard`) for the generation and sharded again after it. Each
data-parallel replica generates on its own pipeline (the same weights, the same tokens), its tokens broadcast
within the replica's ranks; rank `(dp_rank * pp + pp_rank) * tp + tp_rank` as the mesh numbers them. With experts
split over expert-parallel ranks (`--ep`), the replicas of a group step together (`Route.lockstep`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from pipetrain.blocks import BlockSequential
from pipetrain.generate.job import generate_with
from pipetrain.generate.loop import Generated, Route
from pipetrain.generate.prompts import PromptBatch, check_context, encode_prompts, left_pad
from pipetrain.generate.sampling import Sampling
from pipetrain.generate.stage import GenerationStage
from pipetrain.parallel.mesh import Mesh
from pipetrain.pipeline import PipelineEngine
from pipetrain.workloads.hf.text import load_tokenizer

__all__ = ["EngineGenerator", "TrainingSamples"]


def _blocks(module: nn.Module) -> BlockSequential:
    return next(m for m in module.modules() if isinstance(m, BlockSequential))


class EngineGenerator:
    """Generates with `engine`'s stages of an `HFCausalLM` (`config`, its `folder` for the tokenizer) on this rank
    of `mesh`. Create it on every rank at once (it makes one process group per replica)."""

    def __init__(self, engine: PipelineEngine, mesh: Mesh, config: Any, folder: Path) -> None:
        self.engine, self.config, self.folder = engine, config, folder
        pp, tp = mesh.pp, mesh.tp
        rank_of_stage = {stage: rank for rank in range(pp) for stage in engine.config.stage_ids(rank)}
        groups = [dist.new_group(list(range(d * pp * tp, (d + 1) * pp * tp))) if pp * tp > 1 else None
                  for d in range(mesh.dp)]
        base = mesh.dp_rank * pp * tp
        owners = tuple(base + rank_of_stage[k] * tp + mesh.tp_rank for k in range(engine.num_stages))
        self.route = Route(dist.get_rank(), owners, base + rank_of_stage[engine.num_stages - 1] * tp,
                           groups[mesh.dp_rank], tp, lockstep=getattr(engine, "expert_group", None))
        bounds = [sum(engine.balance[:k]) for k in range(len(engine.balance))]
        self.stages = {k: GenerationStage(config, list(_blocks(module)), bounds[k])
                       for k, module in zip(engine.stage_ids, engine.modules)}

    @contextmanager
    def _gathered(self) -> Iterator[None]:
        """FSDP2's parameters whole for the generation, sharded again after it; every block in eval mode."""
        sharded = [m for module in self.engine.modules for m in module.modules() if isinstance(m, FSDPModule)]
        modes = [(block, block.training) for stage in self.stages.values() for block in stage.blocks]
        for module in sharded:
            module.unshard()
        for block, _ in modes:
            block.eval()
        try:
            yield
        finally:
            for block, mode in modes:
                block.train(mode)
            for module in sharded:
                module.reshard()

    def generate(self, batch: PromptBatch, sampling: Sampling, max_new_tokens: int) -> Generated:
        """New tokens for `batch` (a collective call over every rank of the engine's job)."""
        with self._gathered():
            return generate_with(self.stages, self.route, batch, sampling, max_new_tokens, self.folder, self.config)


class TrainingSamples:
    """`--sample-every`: the greedy continuation of `prompt` (`tokens` new tokens) through the engine's stages,
    decoded by the model folder's tokenizer. Create it on every rank at once; `text()` is a collective call."""

    def __init__(self, engine: PipelineEngine, mesh: Mesh, config: Any, folder: Path, prompt: str,
                 tokens: int) -> None:
        self.tokenizer = load_tokenizer(folder)
        ids = encode_prompts(self.tokenizer, [prompt])
        self.batch = left_pad(ids, self.tokenizer.pad_token_id or 0)
        check_context(self.batch.lengths, tokens, config.max_position_embeddings)
        self.generator, self.tokens = EngineGenerator(engine, mesh, config, folder), tokens

    def text(self) -> str:
        done = self.generator.generate(self.batch, Sampling(), self.tokens)
        return self.tokenizer.decode(done.tokens[0].tolist(), skip_special_tokens=True)

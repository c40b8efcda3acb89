"""A generation job: its description (checked once, before any rank starts), each rank's stage, and the rank's
main (join, build, generate, rank 0 prints).

With `ep` > 1 (a mixture of experts) the job runs `ep` replicas of the pp × tp pipeline, rank
`(replica * pp + stage) * tp + tp_rank`, each stage's experts split over the `ep` ranks of its stage and TP rank in
the replicas (`pipetrain.moe.split`; under TP the MoE block is whole on each TP rank, as in training,
`parallel.experts`): every replica generates the same prompts (the same tokens), stepping with the others
(`Route.lockstep`), so that each rank holds 1/ep of its layers' experts."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from pipetrain.blocks import build_blocks
from pipetrain.errors import ConfigError
from pipetrain.generate.loop import Generated, Placement, Route, generate_tokens, stage_blocks
from pipetrain.generate.prompts import PromptBatch, check_context, encode_prompts, left_pad
from pipetrain.generate.sampling import Sampling, Stopping
from pipetrain.generate.stage import GenerationStage
from pipetrain.generate.weights import ModelSource, load_block_weights
from pipetrain.launch.ranks import RankSpec
from pipetrain.parallel import pick_device
from pipetrain.moe.split import check_expert_parallel, expert_parallel_blocks
from pipetrain.parallel.experts import build_expert_groups
from pipetrain.parallel.mesh import build_mesh
from pipetrain.parallel.tensor import check_tensor_parallel, tensor_parallel_blocks
from pipetrain.session import close_session, join_job
from pipetrain.workloads.hf.causal_lm import HFCausalLM
from pipetrain.workloads.hf.text import load_tokenizer

__all__ = ["GenerateJob", "prepare_job", "build_stage", "place_rank", "generate_batch", "generate_with",
           "generate_rank", "eos_ids", "speed_line"]


@dataclass(frozen=True)
class GenerateJob:
    """What to generate, from which model, over how many stages and tensor-parallel ranks."""

    source: ModelSource
    texts: tuple[str, ...]
    pp: int = 1
    tp: int = 1
    chat: bool = False
    max_new_tokens: int = 32
    sampling: Sampling = Sampling()
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.ep * self.pp * self.tp


def eos_ids(folder: Path, config: Any, tokenizer: Any) -> list[int]:
    """The tokens that end a sequence: the folder's generation_config.json's, else the config's, else the
    tokenizer's EOS (as transformers' `generate` reads them)."""
    generation = folder / "generation_config.json"
    eos = json.loads(generation.read_text()).get("eos_token_id") if generation.is_file() else None
    if eos is None:
        eos = config.eos_token_id if config.eos_token_id is not None else tokenizer.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def prepare_job(job: GenerateJob) -> tuple[HFCausalLM, PromptBatch]:
    """The model and the prompts' batch, checked: one ConfigError for a layout that does not split the model and
    for prompts that do not fit in its context with the new tokens."""
    model = job.source.model()
    stage_blocks(model.num_blocks, job.pp, 0)
    check_tensor_parallel(model, job.tp)
    if job.pp < 1 or job.tp < 1 or job.ep < 1:
        raise ConfigError(f"--pp {job.pp} --tp {job.tp} --ep {job.ep}: each must be at least 1",
                          hint="pass --pp 2, --tp 2, --ep 2, ...")
    check_expert_parallel(model, job.ep)
    tokenizer = load_tokenizer(job.source.folder)
    encoded = encode_prompts(tokenizer, list(job.texts), chat=job.chat)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_ids(job.source.folder, model.config,
                                                                                     tokenizer) or [0])[0]
    batch = left_pad(encoded, pad)
    check_context(batch.lengths, job.max_new_tokens, model.config.max_position_embeddings)
    return model, batch


def build_stage(model: HFCausalLM, where: Placement, device: torch.device, *, checkpoint: Path | None = None,
                tp_mesh: DeviceMesh | None = None, expert_group: dist.ProcessGroup | None = None) -> GenerationStage:
    """This rank's stage of `model`: its blocks built on `device`, loaded (from the model's folder, or from
    `checkpoint`), split over `tp_mesh` by the model's TP plan, or their experts over `expert_group`."""
    indices = stage_blocks(model.num_blocks, where.pp, where.stage)
    experts = expert_parallel_blocks(expert_group, model=model) if expert_group is not None else None
    blocks = dict(zip(indices, build_blocks(model, indices, seed=0, device=device)))
    for block in blocks.values():
        block.eval()
    if checkpoint is not None:
        load_block_weights(checkpoint, model, blocks)
    if tp_mesh is not None:
        split = tensor_parallel_blocks(model, tp_mesh)
        blocks = {index: split(index, block) for index, block in blocks.items()}
    if experts is not None:
        blocks = {index: experts(index, block) for index, block in blocks.items()}
    return GenerationStage(model.config, list(blocks.values()), indices.start)


def place_rank(job: GenerateJob, model: HFCausalLM, rank: int, device: torch.device) -> tuple[GenerationStage, Route]:
    """This rank's stage of `model` and its route in `job`'s world of ep replicas × pp × tp (after joining: a
    collective call, every rank makes every group): the TP mesh, the expert-parallel groups (the ranks of one stage
    and TP rank in the `ep` replicas), each replica's group, and (ep > 1) the lockstep over the EP group."""
    mesh = build_mesh(job.ep, job.pp, device, job.tp) if job.tp > 1 or job.ep > 1 else None
    experts = build_expert_groups(mesh, job.ep) if job.ep > 1 else None
    span = job.pp * job.tp
    replicas = [dist.new_group(list(range(r * span, (r + 1) * span))) for r in range(job.ep)] if job.ep > 1 else None
    replica = 0 if mesh is None else mesh.dp_rank
    where = Placement(rank, job.pp, job.tp, first=replica * span)
    stage = build_stage(model, where, device, checkpoint=job.source.checkpoint,
                        tp_mesh=None if mesh is None else mesh.tp_mesh,
                        expert_group=None if experts is None else experts.ep_group)
    route = where.route(None if replicas is None else replicas[replica])
    if experts is not None:
        route = replace(route, lockstep=experts.ep_group)
    return stage, route


def generate_batch(job: GenerateJob, stage: GenerationStage, where: Placement, batch: PromptBatch, model: HFCausalLM,
                   group: dist.ProcessGroup | None = None) -> Generated:
    """Generate `job`'s new tokens for `batch` on this rank's `stage` (a collective call over the job's ranks)."""
    return generate_with({where.stage: stage}, where.route(group), batch, job.sampling, job.max_new_tokens,
                         job.source.folder, model.config)


def generate_with(stages: dict[int, GenerationStage], route: Route, batch: PromptBatch, sampling: Sampling,
                  max_new_tokens: int, folder: Path, config: Any) -> Generated:
    """Generate for `batch` on this rank's `stages` (by stage id) of the model of `folder` (its tokenizer's EOS and
    pad), a collective call over the pipeline's ranks."""
    tokenizer = load_tokenizer(folder)
    eos = eos_ids(folder, config, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or [0])[0]
    stopping = Stopping(batch.ids.shape[0], eos=eos, pad=pad, max_new_tokens=max_new_tokens)
    dtype = next(next(iter(stages.values())).blocks[0].parameters()).dtype
    return generate_tokens(stages, route, batch, sampling, stopping, hidden_size=config.hidden_size, dtype=dtype)


def report(job: GenerateJob, batch: PromptBatch, done: Generated) -> str:
    """What rank 0 prints on standard output: each prompt and its generated text (the speed: `speed_line`)."""
    tokenizer = load_tokenizer(job.source.folder)
    lines = []
    for index, (text, row) in enumerate(zip(job.texts, done.tokens)):
        answer = tokenizer.decode(row.tolist(), skip_special_tokens=True)
        lines.append(f"[{index + 1}] {text}\n--> {answer}")
    return "\n".join(lines)


def speed_line(job: GenerateJob, done: Generated) -> str:
    """What rank 0 prints on standard error: the tokens, prompts, steps and tokens/s of the generation."""
    steps = done.tokens.shape[1]
    return (f"{done.tokens.numel()} tokens ({len(job.texts)} prompts x {steps} steps) in {done.seconds:.2f} s: "
            f"{done.tokens_per_s:.1f} tokens/s at pp={job.pp} tp={job.tp}" + (f" ep={job.ep}" if job.ep > 1 else ""))


def _say(job: GenerateJob, batch: PromptBatch, done: Generated) -> None:
    """The texts on standard output (what a script reads), the figures on standard error."""
    print(report(job, batch, done), flush=True)
    print(speed_line(job, done), file=sys.stderr, flush=True)


def generate_rank(spec: RankSpec, job: GenerateJob) -> Generated:
    """One rank's whole job: join (unless it is the only rank), build its stage, generate; rank 0 prints the texts
    (standard output) and tokens/s (standard error)."""
    model, batch = prepare_job(job)
    if job.world_size == 1:
        device = pick_device(spec.local_rank, spec.device)
        stage = build_stage(model, Placement(0, 1), device, checkpoint=job.source.checkpoint)
        done = generate_batch(job, stage, Placement(0, 1), batch, model)
        _say(job, batch, done)
        return done
    device = join_job(spec)
    try:
        stage, route = place_rank(job, model, spec.rank, device)
        done = generate_with({route.owners.index(spec.rank): stage}, route, batch, job.sampling, job.max_new_tokens,
                             job.source.folder, model.config)
        if spec.rank == 0:
            _say(job, batch, done)
    except BaseException:
        close_session(after_error=True)
        raise
    close_session()
    return done

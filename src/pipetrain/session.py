"""One rank's distributed session: joins the process group, builds the dp × pp × tp mesh and the pipeline engine."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipetrain.blocks import BlockModel
from pipetrain.compat.modules import hold_process_groups
from pipetrain.config import SPLIT_BACKWARD_SCHEDULES, ParallelConfig
from pipetrain.context import ContextParallel, SequenceSplit, check_context_model
from pipetrain.launch.agree import agree_on_layout
from pipetrain.launch.env import apply_socket_interface, join_timeout
from pipetrain.launch.reach import wait_reachable
from pipetrain.launch.ranks import RankSpec
from pipetrain.logs.startup import Startup
from pipetrain.moe.split import expert_parallel_blocks
from pipetrain.parallel import Mesh, build_mesh, data_parallel_wrapper, init_process_group, pick_device
from pipetrain.parallel.experts import ExpertGradients, ExpertGroups, build_expert_groups, is_expert
from pipetrain.parallel.mesh import leave_after_error
from pipetrain.parallel.tensor import tensor_parallel_blocks
from pipetrain.pipeline import Loss, PipelineEngine
from pipetrain.pipeline.precision import AutocastStage, check_precision, compute_dtype, set_fp32_matmuls
from pipetrain.recipe.clip import clip_grad_norm_, grad_norm

__all__ = ["Session", "join_job", "build_session", "open_session", "close_session"]


@dataclass(frozen=True)
class Session:
    """What a rank trains with: its device, its place in the mesh and its pipeline engine."""

    device: torch.device
    mesh: Mesh
    engine: PipelineEngine
    #: seconds of each start-up phase so far on this rank (`open_session` fills it; the first step completes it)
    startup: Startup = field(default_factory=Startup, compare=False)

    @property
    def is_main(self) -> bool:
        """True on the one rank that prints progress (global rank 0)."""
        return dist.get_rank() == 0

    def grad_norm(self, norm_type: float = 2.0) -> float:
        """The global norm of the gradients of the whole model (every stage, replica and shard); a collective
        call, the same value on every rank."""
        return grad_norm(self.engine, norm_type)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """`torch.nn.utils.clip_grad_norm_` over the whole model: scale every gradient by
        `min(1, max_norm / (norm + 1e-6))` of the global norm, which is returned (a collective call)."""
        return clip_grad_norm_(self.engine, max_norm, norm_type)


def join_job(spec: RankSpec, *, cpu_threads: int | None = 1, timeout_s: float = 600.0) -> torch.device:
    """Join the process group of the job described by `spec`; returns this rank's device."""
    device = pick_device(spec.local_rank, spec.device)
    apply_socket_interface(spec.master_addr, nodes=spec.nodes, device_type=device.type)
    if spec.nodes > 1 and spec.rank != 0:  # a bounded wait with one message, not the process group's 10 minutes
        wait_reachable(spec.master_addr, spec.master_port, timeout_s=join_timeout())
    init_process_group(
        rank=spec.rank,
        world_size=spec.world_size,
        master_addr=spec.master_addr,
        master_port=spec.master_port,
        device=device,
        timeout_s=timeout_s,
        cpu_threads=cpu_threads,
    )
    return device


def build_session(
    model: BlockModel,
    parallel: ParallelConfig,
    device: torch.device,
    *,
    seed: int = 0,
    loss_fn: Loss | Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
    precision: str = "fp32",
    startup: Startup | None = None,
) -> Session:
    """Build the dp × pp × tp mesh over the joined world and this rank's stages of `model` (split by its TP plan
    when `parallel.tp` > 1, its experts over the stage's expert-parallel group when `parallel.ep` > 1, before
    DDP/FSDP2 wraps them).

    `precision` "bf16" runs each stage under bf16 autocast with fp32 weights (see `AutocastStage`); on CUDA,
    fp32 matmuls are TF32 except under "fp32-strict" (see `set_fp32_matmuls`). `startup`: where the mesh's and
    the stages' seconds are recorded.
    """
    check_precision(precision)
    set_fp32_matmuls(device, precision)
    parallel.check_world(dist.get_world_size())
    startup = startup or Startup()
    with startup.phase("mesh"):
        mesh = build_mesh(parallel.dp, parallel.pp, device, parallel.tp,
                          dp_shard=parallel.dp_shard if parallel.dp_mode == "hsdp" and parallel.dp > 1 else None,
                          cp=parallel.cp)
        experts = (build_expert_groups(mesh, parallel.ep, backward_group=parallel.pipeline.moe_overlap)
                   if parallel.ep > 1 else None)
    wrap = _stage_wrapper(parallel, mesh, device, precision, experts)
    split = (tensor_parallel_blocks(model, mesh.tp_mesh, sequence_parallel=parallel.sequence_parallel,
                                    loss_parallel=parallel.loss_parallel)
             if mesh.tp_mesh is not None else None)
    cut = None
    if parallel.cp > 1:  # context parallelism: attention over the cut sequence, of the tp rank's heads under tp
        check_context_model(model, parallel.cp)
        split = ContextParallel(mesh.cp_group, parallel.cp_attention, tp=parallel.tp).after(split)
        cut = SequenceSplit(parallel.cp, mesh.cp_rank)
    if experts is not None:  # after tensor parallelism's split and the context attention (one EP group a cp rank)
        split = expert_parallel_blocks(experts.ep_group, model=model, backward_group=experts.ep_backward_group,
                                       before=split, dp_mode=parallel.dp_mode)
    with startup.phase("stages"):
        engine = _engine(model, parallel, device, mesh, loss_fn, seed, wrap, split, cut)
    if experts is not None:
        engine.expert_group, engine.expert_mesh = experts.ep_group, experts.ep_mesh
    if experts is not None and parallel.dp_mode == "ddp":  # FSDP2 reduces them over their own mesh
        engine.expert_grads = ExpertGradients([p for p in engine.parameters() if is_expert(p)], experts)
    return Session(device=device, mesh=mesh, engine=engine, startup=startup)


def _engine(model: BlockModel, parallel: ParallelConfig, device: torch.device, mesh: Mesh, loss_fn, seed: int, wrap,
            split, cut: SequenceSplit | None = None) -> PipelineEngine:
    """This rank's stages of `model` and their schedule."""
    return PipelineEngine(
        model,
        parallel.pipeline,
        device=device,
        pp_group=mesh.pp_group,
        loss_fn=loss_fn,
        seed=seed,
        dp=mesh.replicas,
        dp_group=mesh.dp_group,
        wrap=wrap,
        split_block=split,
        counts_metrics=mesh.tp_rank == 0,
        sequence_split=cut,
    )


def _stage_wrapper(
    parallel: ParallelConfig, mesh: Mesh, device: torch.device, precision: str, experts: ExpertGroups | None = None
) -> Callable[[torch.nn.Module], torch.nn.Module] | None:
    """Autocast (for a reduced precision) inside data parallelism (DDP/FSDP), applied to each stage module."""
    replicate = data_parallel_wrapper(
        parallel.dp_mode, mesh, stages_per_rank=parallel.pipeline.virtual_stages, precision=precision,
        reshard=parallel.fsdp_reshard, split_backward=parallel.pipeline.schedule in SPLIT_BACKWARD_SCHEDULES,
        experts=experts,
    )
    if compute_dtype(precision) is None:
        return replicate

    def wrap(module: torch.nn.Module) -> torch.nn.Module:
        stage = AutocastStage(module, precision, device.type)
        return replicate(stage) if replicate else stage

    return wrap


def open_session(
    spec: RankSpec,
    model: BlockModel,
    parallel: ParallelConfig,
    *,
    seed: int = 0,
    loss_fn: Loss | Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
    cpu_threads: int | None = 1,
    timeout_s: float = 600.0,
    precision: str = "fp32",
) -> Session:
    """Join the job described by `spec` and build this rank's stages of `model` for the `parallel` mesh.

    `precision`: "fp32" (default; TF32 matmuls on CUDA), "fp32-strict" (IEEE fp32 on CUDA too) or "bf16"
    (autocast, fp32 master weights and optimizer state).
    """
    check_precision(precision)
    parallel.check_world(spec.world_size)
    startup = Startup(started_at=spec.launched_at)  # the job's age now: its start, imports and data
    with startup.phase("join"):
        device = join_job(spec, cpu_threads=cpu_threads, timeout_s=timeout_s)
    with startup.phase("layout check"):
        agree_on_layout(parallel)  # nodes started with other flags that fit the same world size: one message
    return build_session(model, parallel, device, seed=seed, loss_fn=loss_fn, precision=precision, startup=startup)


def close_session(*, after_error: bool = False) -> None:
    """Leave the process group (safe to call when none was joined). `after_error`: this rank failed, so never
    block on the group (see `parallel.mesh.leave_after_error`): the error is reported first."""
    if after_error:
        leave_after_error()
    elif dist.is_initialized():
        hold_process_groups()  # the session's DDP reducers, freed after this, must not free a group (compat)
        dist.destroy_process_group()

"""The process group and the dp × pp × tp device mesh: which device, backend and groups each rank uses."""

from __future__ import annotations

import atexit
import gc
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pipetrain.compat.mesh import flatten_mesh
from pipetrain.compat.modules import abort_process_group
from pipetrain.launch.device import pick_device

__all__ = ["Mesh", "pick_device", "init_process_group", "build_mesh", "leave_after_error", "PRIVATE_C10D"]

#: Private torch names used here (tests/unit/test_leave_after_error.py fails loudly when one moves).
PRIVATE_C10D = ("_abort_process_group",)


def init_process_group(
    *,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    device: torch.device,
    timeout_s: float = 600.0,
    cpu_threads: int | None = 1,
) -> None:
    """Join the job's process group: NCCL on CUDA, gloo on the CPU (with `cpu_threads` intra-op threads)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        backend = "gloo"
        if cpu_threads:
            torch.set_num_threads(cpu_threads)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    atexit.unregister(_leave_at_exit)  # once per process, however often it joins
    atexit.register(_leave_at_exit)


def _leave_at_exit() -> None:
    """Destroy the process group while the interpreter is still whole (a no-op if the script already did).

    A script that ends without `destroy_process_group` (the `Pipe` tutorial's loop does) leaves gloo's worker
    threads holding work and tensors; freed during the interpreter's finalization they abort the process
    ("terminate called without an active exception", SIGABRT) after its work succeeded (pytorch/pytorch#179291).
    """
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def leave_after_error() -> str:
    """Leave the process group after this rank failed, without waiting on it; returns what was done.

    NCCL's `destroy_process_group` can block on the failed work (pytorch/pytorch#141510): the error would never be
    reported and a peer's watchdog would blame the wrong rank. An NCCL group is aborted instead ("aborted":
    non-blocking, and the peers' pending calls fail at once); a gloo group is left to the exit hook, after the
    error is reported ("left").
    """
    if not dist.is_initialized():
        return "none"
    if dist.get_backend() == "nccl":
        abort_process_group()
        return "aborted"
    return "left"


@dataclass(frozen=True)
class Mesh:
    """This rank's place in the dp × pp × tp mesh: rank = (dp_rank * pp + pp_rank) * tp + tp_rank, so a
    tensor-parallel group is `tp` neighbouring ranks (one node) and a pipeline's ranks are `tp` apart.

    With tp == 1 the device mesh is 2-D (dp, pp), else 3-D (dp, pp, tp). Under HSDP (`dp_shard` > 0) the dp axis
    is itself two, (dp_replicate, dp_shard), shard groups innermost, with "dp" their flattened whole.

    Context parallelism (cp > 1): each data replica's `cp` ranks of a stage hold other tokens of the same
    parameters, so the mesh's "dp" dimension spans dp * cp ranks (replica = dp_rank * cp + cp_rank): `dp_group` and
    `dp_mesh` reduce gradients over data and context ranks alike, `dp` counts the data replicas, `cp_group` is the
    `cp` ranks that share one stage's sequences."""

    device_mesh: DeviceMesh
    dp_rank: int
    pp_rank: int
    tp_rank: int = 0
    cp_rank: int = 0
    cp: int = 1
    cp_group: dist.ProcessGroup | None = None
    #: ranks of one HSDP shard group (0: no HSDP split of the dp axis)
    dp_shard: int = 0

    @property
    def dp(self) -> int:
        """Data replicas (each reads its own share of the batch)."""
        return self.replicas // self.cp

    @property
    def replicas(self) -> int:
        """Ranks holding the same parameters of a stage: dp * cp (their gradients are reduced together)."""
        return self.device_mesh["dp"].size() if self.dp_shard else self.device_mesh.size(0)

    @property
    def pp(self) -> int:
        return self.device_mesh["pp"].size()

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.device_mesh.get_group("dp")

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.device_mesh.get_group("pp")

    @property
    def dp_mesh(self) -> DeviceMesh:
        return self.device_mesh["dp"]

    @property
    def shard_mesh(self) -> DeviceMesh:
        """The mesh FSDP2 shards over: the 1-D dp axis, or HSDP's 2-D (dp_replicate, dp_shard)."""
        return self.device_mesh["dp_replicate", "dp_shard"] if self.dp_shard else self.device_mesh["dp"]

    @property
    def tp(self) -> int:
        names = self.device_mesh.mesh_dim_names or ()
        return self.device_mesh["tp"].size() if "tp" in names else 1

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        """The 1-D mesh of this rank's tensor-parallel group (None when tp == 1)."""
        return self.device_mesh["tp"] if "tp" in (self.device_mesh.mesh_dim_names or ()) else None


def build_mesh(dp: int, pp: int, device: torch.device, tp: int = 1, dp_shard: int | None = None,
               cp: int = 1) -> Mesh:
    """The dp × pp × tp mesh over the initialised world (whose size must be dp * pp * tp), tp innermost; with
    `dp_shard` (HSDP) the dp axis is made of dp / dp_shard replicas of shard groups of `dp_shard` neighbours; with
    context parallelism, dp × cp × pp × tp (the mesh's "dp" dimension of dp * cp ranks, see `Mesh`)."""
    if cp > 1:
        return _context_mesh(dp, pp, device, tp, cp, dp_shard)
    rank = dist.get_rank()
    if dp_shard:
        names = ("dp_replicate", "dp_shard", "pp") + (("tp",) if tp > 1 else ())
        shape = (dp // dp_shard, dp_shard, pp) + ((tp,) if tp > 1 else ())
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
        flatten_mesh(mesh["dp_replicate", "dp_shard"], "dp")
        return Mesh(device_mesh=mesh, dp_rank=rank // (pp * tp), pp_rank=(rank // tp) % pp, tp_rank=rank % tp,
                    dp_shard=dp_shard)
    if tp == 1:
        mesh = init_device_mesh(device.type, (dp, pp), mesh_dim_names=("dp", "pp"))
        return Mesh(device_mesh=mesh, dp_rank=rank // pp, pp_rank=rank % pp)
    mesh = init_device_mesh(device.type, (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))
    return Mesh(device_mesh=mesh, dp_rank=rank // (pp * tp), pp_rank=(rank // tp) % pp, tp_rank=rank % tp)


def _context_mesh(dp: int, pp: int, device: torch.device, tp: int, cp: int, dp_shard: int | None = None) -> Mesh:
    """The mesh with cp > 1: rank = ((dp_rank * cp + cp_rank) * pp + pp_rank) * tp + tp_rank. Under HSDP a shard
    group is `dp_shard` data replicas with their cp ranks (dp_shard * cp neighbours of the "dp" dimension, so a
    replica's cp ranks share one group), dp / dp_shard such groups replicated."""
    rank = dist.get_rank()
    tail, tail_names = ((pp, tp), ("pp", "tp")) if tp > 1 else ((pp,), ("pp",))
    if dp_shard:
        mesh = init_device_mesh(device.type, (dp // dp_shard, dp_shard * cp) + tail,
                                mesh_dim_names=("dp_replicate", "dp_shard") + tail_names)
        flatten_mesh(mesh["dp_replicate", "dp_shard"], "dp")
    else:
        mesh = init_device_mesh(device.type, (dp * cp,) + tail, mesh_dim_names=("dp",) + tail_names)
    groups = [[((d * cp + c) * pp + p) * tp + t for c in range(cp)]
              for d in range(dp) for p in range(pp) for t in range(tp)]
    cp_group, _ = dist.new_subgroups_by_enumeration(groups)
    replica = rank // (pp * tp)
    return Mesh(device_mesh=mesh, dp_rank=replica // cp, pp_rank=(rank // tp) % pp, tp_rank=rank % tp,
                cp_rank=replica % cp, cp=cp, cp_group=cp_group, dp_shard=dp_shard * cp if dp_shard else 0)

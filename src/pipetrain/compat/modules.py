"""Private names of torch's modules, tensor functions and process groups: the base classes of dropout and batch norm,
`torch._foreach_mul_` (one fused multiply of many tensors), aborting the default process group, holding the process
groups through a session's teardown, and the parameters DDP is told to leave alone."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

__all__ = ["is_dropout", "is_batch_norm", "foreach_mul_", "abort_process_group", "hold_process_groups", "flight_record", "ddp_ignore"]


def is_dropout(module: nn.Module) -> bool:
    """Whether `module` is one of torch's dropout layers (`nn.Dropout`, `Dropout1d/2d/3d`, `AlphaDropout`, ...)."""
    return isinstance(module, _DropoutNd)


def is_batch_norm(module: nn.Module) -> bool:
    """Whether `module` is one of torch's batch norms (`BatchNorm1d/2d/3d`, `SyncBatchNorm`, lazy ones)."""
    return isinstance(module, _BatchNorm)


def foreach_mul_(tensors: Sequence[torch.Tensor], scalar: float) -> None:
    """Multiply every tensor of `tensors` by `scalar` in place, in one fused call."""
    torch._foreach_mul_(list(tensors), scalar)


def abort_process_group() -> None:
    """Abort the default process group without waiting on its pending work (NCCL; never blocks)."""
    from torch.distributed import distributed_c10d  # only when aborting: torch.distributed may be absent

    distributed_c10d._abort_process_group()


#: the process groups of the last session closed in this process (`hold_process_groups`)
_held: list = []


def hold_process_groups() -> None:
    """Keep a Python reference to every process group of this process until the next call (then the older groups
    go, long after their last collective).

    A DDP `Reducer` is a C++ object whose deallocation keeps the GIL; when it drops the last reference to a gloo
    group right after a collective, the group's destructor waits for a worker thread that is freeing that
    collective's tensors and needs the GIL: the rank hangs after its work is done (pytorch/pytorch#56297). Held
    here, the group outlives the reducer, and its own Python object, which releases the GIL when it goes, frees it.
    Call before `destroy_process_group`, which forgets the groups (torch 2.13 lists them in `_world.pg_map` only).
    """
    from torch.distributed import distributed_c10d  # only when closing: torch.distributed may be absent

    _held[:] = list(distributed_c10d._world.pg_map)


def flight_record(backend: str) -> bytes | None:
    """torch's flight recorder of this process's NCCL collectives (a pickle, as `TORCH_FR_DUMP_TEMP_FILE` files are),
    or None: another backend, or a torch without it. Recorded only when `TORCH_FR_BUFFER_SIZE` was set before the
    process group started (`launch.env.flight_recorder_variables`)."""
    if backend != "nccl":
        return None
    from torch._C import _distributed_c10d

    dump = getattr(_distributed_c10d, "_dump_nccl_trace", None) or getattr(_distributed_c10d, "_dump_fr_trace", None)
    try:
        return None if dump is None else dump()
    except RuntimeError:
        return None


def ddp_ignore(module: nn.Module, names: Sequence[str]) -> None:
    """Tell DDP, before it wraps `module`, to neither broadcast nor reduce the parameters `names` (names in `module`):
    torch's own switch for it (pytorch/pytorch#43690 keeps it private)."""
    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, list(names))

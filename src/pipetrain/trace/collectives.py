"""Tensor-parallel collectives in a trace: DTensor's redistributions over the `tp` mesh axis timed as spans.

Every collective a TP-split block runs — the row-parallel output's all-reduce in forward, the replicated input's
gradient all-reduce in backward, the all-gather / reduce-scatter pairs of sequence parallelism — goes through
one of DTensor's placement methods (`Partial._reduce_value`, `Shard._reduce_shard_tensor`,
`Shard._to_replicate_tensor`, `Shard._to_new_shard_dim`, `_StridedShard._to_replicate_tensor`), called by
`redistribute_local_tensor` in forward and in autograd's backward alike. While a step is recorded
(`tp_collective_spans`), those methods are wrapped on their classes: a call over a mesh dimension named "tp"
is recorded as a span of its own kind (`TP_KINDS`), and its result is waited for inside the span, so the span
holds the collective's completion (DTensor issues the row-parallel all-reduce asynchronously and waits at the
first use, a few operations later; on CUDA the wait is a stream dependency, no host synchronisation). Outside a
recorded step nothing is wrapped: tracing off costs nothing. Collectives over other axes (FSDP's own
all-gathers do not go through these methods; a `full_tensor()` over dp would) are not TP and not recorded.

The wrapped names are private torch API: `pipetrain.compat.dtensor` wraps them (`PLACEMENT_COLLECTIVES`) and
tests/unit/test_compat.py fails loudly when one moves.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from pipetrain.compat.dtensor import wrapped_placement_methods
from pipetrain.pipeline.timeline import Recorder

__all__ = ["TP_AXIS", "tp_collective_spans"]

#: The mesh dimension whose collectives are tensor parallelism's (parallel/mesh.py names it so).
TP_AXIS = "tp"

def _over_tp(mesh: Any, mesh_dim: Any) -> bool:
    names = getattr(mesh, "mesh_dim_names", None)
    return bool(names) and isinstance(mesh_dim, int) and 0 <= mesh_dim < len(names) and names[mesh_dim] == TP_AXIS


def _argument(args: tuple, kwargs: dict, position: int, name: str) -> Any:
    return args[position] if len(args) > position else kwargs.get(name)


def _timed(method: Callable[..., Any], kind: str, recorder: Recorder, busy: list[bool]) -> Callable[..., Any]:
    names = list(inspect.signature(method).parameters)
    mesh_at, dim_at = names.index("mesh"), names.index("mesh_dim")  # ValueError: torch renamed them

    @functools.wraps(method)
    def timed(*args: Any, **kwargs: Any) -> Any:
        if busy[0] or not _over_tp(_argument(args, kwargs, mesh_at, "mesh"), _argument(args, kwargs, dim_at, "mesh_dim")):
            return method(*args, **kwargs)  # nested inside one collective, or not the TP axis
        busy[0] = True
        start = recorder.clock.mark()
        try:
            result = method(*args, **kwargs)
            wait = getattr(result, "wait", None)  # funcol.AsyncCollectiveTensor: complete it inside the span
            return wait() if callable(wait) else result
        finally:
            recorder.add(kind, start, recorder.clock.mark())
            busy[0] = False

    return timed


@contextmanager
def tp_collective_spans(recorder: Recorder) -> Iterator[None]:
    """Inside the block (one recorded step), record every TP collective of this rank into `recorder`."""
    busy = [False]
    with wrapped_placement_methods(lambda method, kind: _timed(method, kind, recorder, busy)):
        yield

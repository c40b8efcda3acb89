"""DDP for stage modules that need `find_unused_parameters=True`, without torch's warning that they do not.

Interleaved schedules run several stages per rank, whose backward passes interleave: DDP is only correct with
`find_unused_parameters=True` there (see DESIGN.md), and torch then warns once per process from C++, on the
process's stderr, that no unused parameter was found. That one line is noise to the user; the warning cannot
be filtered with `warnings`, so the first forward (where DDP emits it) runs with stderr captured, and every
other line written meanwhile is written back.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

from torch.nn.parallel import DistributedDataParallel

__all__ = ["QuietDistributedDataParallel", "stderr_without"]

#: The start of torch's warning (reducer.cpp) this module removes.
UNUSED_PARAMETERS_WARNING = "find_unused_parameters=True was specified in DDP constructor"


@contextmanager
def stderr_without(text: str) -> Iterator[None]:
    """Capture what is written to file descriptor 2 inside the block; write it back without the lines holding `text`."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            lines = capture.read().decode(errors="replace").splitlines(keepends=True)
            kept = "".join(line for line in lines if text not in line)
            if kept:
                sys.stderr.write(kept)
                sys.stderr.flush()


class _QuietReducer:
    """Stands for DDP's C++ reducer; its first `prepare_for_backward` in the process (where DDP searches for
    unused parameters and warns) runs with stderr filtered. Everything else is the reducer's own."""

    _warned: ClassVar[bool] = False

    def __init__(self, reducer: Any) -> None:
        self._reducer = reducer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)

    def prepare_for_backward(self, outputs: Any) -> None:
        if _QuietReducer._warned:
            self._reducer.prepare_for_backward(outputs)
            return
        _QuietReducer._warned = True
        with stderr_without(UNUSED_PARAMETERS_WARNING):
            self._reducer.prepare_for_backward(outputs)


class QuietDistributedDataParallel(DistributedDataParallel):
    """`DistributedDataParallel` without the line torch prints when `find_unused_parameters=True` finds none.

    torch's pipelining stages call `reducer.prepare_for_backward` themselves before the last backward of a step,
    which is where the warning comes from; the reducer is wrapped so that the first such call is filtered.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.find_unused_parameters:
            self.reducer = _QuietReducer(self.reducer)

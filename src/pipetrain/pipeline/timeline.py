"""Recording one rank's pipeline timeline: timed wrappers around the stages' chunk work and the P2P waits.

torch 2.13's schedules name their work for `torch.profiler` only partly (`ScheduleGPipe` wraps each
micro-batch's receive + compute + send in one range, `Schedule1F1B` emits no range at all), so compute
and waiting are timed here: while a `Recorder` records, `PipelineStage.forward_one_chunk`,
`backward_one_chunk` (full, or input-grad only for zero-bubble), `backward_weight_one_chunk` and
`perform_reduce_grad` are wrapped on the class, the schedules' P2P waits are timed (see
`compat.timed_p2p_waits`), and forwards of recomputed modules inside a backward are marked. Nothing is
wrapped when no step is recorded: `span()` then costs one global lookup.

Times come from the recorder's clock (`pipeline.clock`): host nanoseconds on the CPU; on CUDA, events on the
stream, resolved to host nanoseconds after the step (host time would measure kernel launches, not work).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

from torch import nn
from torch.distributed.pipelining import PipelineStage

from pipetrain.pipeline.clock import Clock, HostClock
from pipetrain.compat.pipelining import timed_p2p_waits

__all__ = ["Record", "Recorder", "span"]

#: (kind, start_ns, end_ns, step, stage, microbatch) on this rank's `time.perf_counter_ns` clock.
Record = tuple[str, int, int, int, int, int]

_ACTIVE: Recorder | None = None


@contextmanager
def span(kind: str, *, stage: int = -1, microbatch: int = -1) -> Iterator[None]:
    """Time the block as `kind` (e.g. "optimizer", "metrics") if a step is being recorded; else do nothing."""
    recorder = _ACTIVE
    if recorder is None:
        yield
        return
    start = recorder.clock.mark()
    try:
        yield
    finally:
        recorder.add(kind, start, recorder.clock.mark(), stage=stage, microbatch=microbatch)


class Recorder:
    """Collects this rank's records of the steps run inside `recording(step)`.

    `recompute_modules` are the modules that `checkpoint` re-runs in backward (the engine's
    `RecomputeWrapper.module`s): their forwards inside a backward are recorded as "recompute" (the end hook
    runs even when `checkpoint` stops the recomputation early by raising). `clock`: see `pipeline.clock`
    (default: the host's).
    """

    def __init__(self, recompute_modules: Sequence[nn.Module] = (), clock: Clock | None = None) -> None:
        self.records: list[Record] = []
        self.clock: Clock = clock or HostClock()
        self._pending: list[tuple[str, object, object, int, int, int]] = []
        self._recompute_modules = list(recompute_modules)
        self._step = -1
        self._in_backward: tuple[int, int] | None = None  # (stage, micro-batch) of the running backward
        self._recompute_start: object | None = None

    def add(self, kind: str, start: object, end: object, *, stage: int = -1, microbatch: int = -1) -> None:
        """Record a span between two marks of `clock` (resolved into `records` when the step's recording ends)."""
        self._pending.append((kind, start, end, self._step, stage, microbatch))

    def _resolve(self) -> None:
        self.clock.finish()
        resolve = self.clock.resolve
        self.records.extend((kind, resolve(start), resolve(end), step, stage, mb)
                            for kind, start, end, step, stage, mb in self._pending)
        self._pending.clear()

    @contextmanager
    def recording(self, step: int) -> Iterator[None]:
        """Record everything the pipeline does inside the block as traced step `step` (plus its `step` span)."""
        global _ACTIVE
        if _ACTIVE is not None:
            raise RuntimeError("a pipeline step is already being recorded on this rank")
        self._step = step
        self.clock.begin()
        with ExitStack() as stack:
            stack.callback(self._resolve)  # last: after the step span is added
            stack.enter_context(timed_p2p_waits(lambda start, end: self.add("wait", start, end), self.clock.mark))
            for name, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"),
                               ("backward_weight_one_chunk", "W"), ("perform_reduce_grad", "dp")):
                stack.enter_context(_wrapped(PipelineStage, name, self._timer(kind)))
            for module in self._recompute_modules:
                stack.callback(module.register_forward_pre_hook(self._recompute_begin).remove)
                stack.callback(module.register_forward_hook(self._recompute_end, always_call=True).remove)
            _ACTIVE = self
            stack.callback(_clear_active)
            start = self.clock.mark()
            try:
                yield
            finally:
                self.add("step", start, self.clock.mark())

    def _timer(self, kind: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        recorder = self

        def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(method)
            def timed(stage: PipelineStage, *args: Any, **kwargs: Any) -> Any:
                chunk = -1 if kind == "dp" else int(args[0] if args else next(iter(kwargs.values())))
                label = kind
                if kind == "B" and not kwargs.get("full_backward", args[2] if len(args) > 2 else True):
                    label = "I"  # zero-bubble: input gradients now, weight gradients later ("W")
                if label in ("B", "I"):
                    recorder._in_backward = (stage.stage_index, chunk)
                start = recorder.clock.mark()
                try:
                    return method(stage, *args, **kwargs)
                finally:
                    recorder.add(label, start, recorder.clock.mark(), stage=stage.stage_index, microbatch=chunk)
                    recorder._in_backward = None

            return timed

        return wrap

    def _recompute_begin(self, module: nn.Module, args: Any) -> None:
        if self._in_backward is not None:
            self._recompute_start = self.clock.mark()

    def _recompute_end(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._in_backward is not None and self._recompute_start is not None:
            stage, chunk = self._in_backward
            self.add("recompute", self._recompute_start, self.clock.mark(), stage=stage, microbatch=chunk)
            self._recompute_start = None


def _clear_active() -> None:
    global _ACTIVE
    _ACTIVE = None


@contextmanager
def _wrapped(cls: type, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """Replace `cls.name` by `wrap(original)` inside the block."""
    own = name in cls.__dict__
    original = cls.__dict__[name] if own else getattr(cls, name)
    setattr(cls, name, wrap(original))
    try:
        yield
    finally:
        if own:
            setattr(cls, name, original)
        else:
            delattr(cls, name)  # inherited: uncover the base class's method again

"""Tracing a training loop on every rank: which steps to record, clocks aligned, files written by rank 0.

    tracer = Tracer(engine, "trace-out", steps=3, warmup=2)
    for x, y in batches:
        with tracer.step():
            optimizer.zero_grad()
            engine.step(x, y)
            with tracer.span("optimizer"):
                optimizer.step()
    files = tracer.close()   # on rank 0: TraceFiles (trace.json, gantt.png, summary); None elsewhere

`finish(say=...)` is `close()` with the close-out of a training run: the files and the summary logged, and a run
that stopped before any traced step told so instead of failing.

With `out_dir=None` nothing is written: rank 0 gets the summary only (as `pipetrain bench` uses it).

Every rank must call `step()` the same number of times and `close()` once (it gathers over the job).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import torch.distributed as dist

from pipetrain.errors import ConfigError
from pipetrain.pipeline import PipelineEngine
from pipetrain.pipeline.recompute import RecomputeWrapper
from pipetrain.pipeline.clock import clock_for
from pipetrain.pipeline.timeline import Recorder, span
from pipetrain.trace.collectives import tp_collective_spans
from pipetrain.trace.files import TraceFiles, check_trace_dir, trace_result, write_trace_files
from pipetrain.trace.spans import Span, within_compute
from pipetrain.trace.summary import ideal_bubble

__all__ = ["Tracer"]

log = logging.getLogger("pipetrain")


class Tracer:
    """Records steps `warmup` .. `warmup + steps - 1` (counted from 0) of `engine`'s loop on this rank."""

    def __init__(self, engine: PipelineEngine, out_dir: str | Path | None, *, steps: int = 3, warmup: int = 2,
                 title: str = "") -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ConfigError(f"--trace-steps {steps!r} traces no step", hint="pass --trace-steps 1 or more")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ConfigError(f"--trace-warmup {warmup!r} is not a step count", hint="pass --trace-warmup 0 or more")
        self.out_dir = None if out_dir is None else Path(out_dir)
        if self.out_dir is not None:
            check_trace_dir(self.out_dir)
        self.steps, self.warmup = steps, warmup
        self.engine = engine
        config = engine.config
        self.title = title or (f"{config.schedule}, pp={config.pp}, chunks={config.n_microbatches}, "
                               f"{config.virtual_stages} stage(s) per rank")
        wrappers = [m for module in engine.modules for m in module.modules() if isinstance(m, RecomputeWrapper)]
        self._recorder = Recorder([m for w in wrappers for m in w.recompute_modules], clock_for(engine.device))
        self._seen = 0

    @property
    def traced_steps(self) -> int:
        """Steps recorded so far."""
        return max(0, min(self._seen - self.warmup, self.steps))

    @contextmanager
    def step(self) -> Iterator[bool]:
        """Wrap one training step (same on every rank); yields whether this step is recorded."""
        index = self._seen
        self._seen += 1
        if not self.warmup <= index < self.warmup + self.steps:
            yield False
            return
        with self._recorder.recording(index - self.warmup), tp_collective_spans(self._recorder):
            yield True

    def span(self, kind: str) -> AbstractContextManager[None]:
        """Time a part of the step that is not the pipeline's, e.g. "optimizer"."""
        return span(kind)

    def close(self) -> TraceFiles | None:
        """Gather every rank's records; rank 0 writes the files and returns them (other ranks: None)."""
        if self.traced_steps == 0:
            raise ConfigError(
                f"the trace recorded no step: the loop ran {self._seen} step(s), the trace starts after "
                f"{self.warmup} warm-up step(s)",
                hint="run more steps (--max-steps) or lower --trace-warmup")
        offset = _clock_offset_ns()  # here, not in a traced step: it costs a barrier and a gather
        mine = [(kind, start + offset, end + offset, step, stage, mb)
                for kind, start, end, step, stage, mb in self._recorder.records]
        world = dist.get_world_size() if dist.is_initialized() else 1
        gathered: list[list | None] = [None] * world
        if world > 1:
            dist.all_gather_object(gathered, mine)
        else:
            gathered = [mine]
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank != 0:
            return None
        spans = within_compute([Span(r, kind, start, end, step, stage, mb)
                                for r, records in enumerate(gathered) for kind, start, end, step, stage, mb in records or []])
        config = self.engine.config
        ideal = ideal_bubble(config.schedule, config.pp, config.n_microbatches, config.virtual_stages)
        metadata = {"schedule": config.schedule, "pp": config.pp, "chunks": config.n_microbatches,
                    "stages_per_rank": config.virtual_stages, "traced_steps": self.traced_steps,
                    "warmup_steps": self.warmup, "world_size": world}
        if self.out_dir is None:
            return trace_result(spans, ideal_bubble=ideal)
        return write_trace_files(spans, self.out_dir, ideal_bubble=ideal, title=self.title, metadata=metadata)


    def finish(self, *, say: bool) -> TraceFiles | None:
        """`close()`, and on rank 0 its files and summary lines logged; when the run stopped before any traced step
        (e.g. by a signal during the warm-up), nothing is gathered nor written, which `say` (rank 0) tells."""
        if self.traced_steps == 0:
            if say:
                log.info("pipetrain: the run stopped before any step was traced: no trace written")
            return None
        files = self.close()
        if files is not None:
            for line in [f"trace of {self.traced_steps} step(s): {files.trace} (open in ui.perfetto.dev), {files.gantt}",
                         *files.lines()]:
                log.info("pipetrain: %s", line)
        return files


def _clock_offset_ns() -> int:
    """What to add to this rank's `perf_counter_ns` to get rank 0's clock.

    Ranks on rank 0's host share its monotonic clock (offset 0). Elsewhere the offset is estimated from
    the moment every rank leaves a barrier (error: the barrier's release skew, typically tens of us; the
    clocks' drift over the run is negligible, so measuring it after the traced steps is as good).
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return 0
    dist.barrier()
    now = time.perf_counter_ns()
    host = socket.gethostname()
    gathered: list[tuple[str, int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (host, now))
    host0, now0 = gathered[0]  # type: ignore[misc]
    return 0 if host == host0 else now0 - now

"""The progress sink: what rank 0's console says of a run besides the step lines: its banner, a tqdm bar per epoch
(loss, learning rate, gradient norm), each epoch's line, and the best held-out result once the run has ended."""

from __future__ import annotations

import logging
import threading

from tqdm import tqdm

from pipetrain.logs.records import EvalRecord, StepRecord

__all__ = ["ProgressSink"]

log = logging.getLogger("pipetrain")


class ProgressSink:
    """Rank 0's progress: `banner(text)` once, `begin_epoch` / `end_epoch` around each epoch's steps (a bar when
    `bar`, updated by every step record), `epoch(line)` per epoch report and `end(best)` when the run ends."""

    def __init__(self, *, bar: bool) -> None:
        self.show_bar = bar
        self.bar: tqdm | None = None
        tqdm.set_lock(threading.RLock())  # not tqdm's default multiprocessing lock: a killed rank would leak its semaphore

    def banner(self, text: str) -> None:
        log.info("pipetrain: %s", text)

    def begin_epoch(self, epoch: int, *, total: int, done: int) -> None:
        """Epoch `epoch` runs `total` steps, `done` of them already (a resumed run)."""
        self.bar = tqdm(total=total, initial=done, desc=f"epoch {epoch}", unit="step", disable=not self.show_bar,
                        leave=False, dynamic_ncols=True)

    def step(self, record: StepRecord) -> None:
        if self.bar is not None:
            grad_norm = "" if record.grad_norm is None else f"{record.grad_norm:.3f}"
            self.bar.set_postfix(loss=f"{record.loss:.4f}", lr=f"{record.lr:.2e}", grad_norm=grad_norm)
            self.bar.update()

    def eval(self, record: EvalRecord) -> None:
        pass

    def end_epoch(self) -> None:
        """The epoch's steps are done (or the run stops within it): the bar goes."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def epoch(self, line: str) -> None:
        log.info(line)

    def end(self, best: str | None) -> None:
        """The run ended (finished or stopped, not failed): `best`, the best held-out result's line, is said."""
        if best:
            log.info("pipetrain: %s", best)

    def close(self) -> None:
        self.end_epoch()

"""The prediction sink: after the first steps, the measured step time and memory beside the predicted ones
(`--layout auto` says what it expects; this line says what it got)."""

from __future__ import annotations

import logging
import statistics

from pipetrain.logs.records import EvalRecord, StepRecord

__all__ = ["PredictionSink", "prediction_line"]

log = logging.getLogger("pipetrain")


def prediction_line(predicted_s: float, predicted_mb: float, times: list[float], first: int, last: int,
                    memory_mb: float | None) -> str:
    """e.g. ``--layout auto: predicted 0.150 s/step, 412 MB on rank 0; measured 0.163 s/step (+8.7 %) over steps
    2-5, 398 MB (-3.4 %)``."""
    measured = statistics.median(times)
    line = (f"pipetrain: --layout auto: predicted {predicted_s:.3f} s/step, {predicted_mb:.0f} MB on rank 0; "
            f"measured {measured:.3f} s/step ({100 * (measured / predicted_s - 1):+.1f} %, median of steps "
            f"{first}-{last})")
    if memory_mb is not None:
        line += f", {memory_mb:.0f} MB ({100 * (memory_mb / predicted_mb - 1):+.1f} %)"
    return line


class PredictionSink:
    """Logs `prediction_line` once, after step `after` (or the run's last step, if sooner); step 1 (warm-up:
    first schedule build, allocator) is left out of the measured median when later steps exist."""

    def __init__(self, predicted_s: float, predicted_mb: float, *, after: int = 5, total_steps: int | None = None):
        self.predicted_s, self.predicted_mb = predicted_s, predicted_mb
        self.after = min(after, total_steps) if total_steps else after
        self.records: list[StepRecord] = []
        self.done = False

    def step(self, record: StepRecord) -> None:
        if self.done:
            return
        self.records.append(record)
        if record.step >= self.after:
            timed = self.records[1:] or self.records
            log.info(prediction_line(self.predicted_s, self.predicted_mb, [r.step_time_s for r in timed],
                                     timed[0].step, timed[-1].step, record.peak_mem_mb))
            self.done = True

    def eval(self, record: EvalRecord) -> None:
        pass

    def close(self) -> None:
        pass

"""How the calibration times and fits: a median of repeats, the median ratio of pairs run in alternation,
least-squares lines, and the reference Transformer whose layer is timed."""

from __future__ import annotations

import statistics
from collections.abc import Callable

from pipetrain.pipeline.clock import Clock
from pipetrain.workloads.classifier.model import TransformerClassifier
from pipetrain.workloads.classifier.presets import TransformerConfig

__all__ = ["LayerShape", "once", "median_time", "paired_ratio", "line_fit", "relative_fit", "reference_model"]

LayerShape = dict  # seq_len, emsize, nhead, nhid, dropout (the planned model's encoder layer)


def once(fn: Callable[[], None], clock: Clock) -> float:
    """Seconds `fn` took on the device (`clock`: on CUDA, synchronised before and after, so that queued kernels
    and NCCL calls are timed to their end, not to their launch)."""
    return clock.seconds(fn)


def median_time(fn: Callable[[], None], repeats: int, clock: Clock) -> float:
    """The median seconds of `repeats` runs of `fn` after a warm-up run."""
    fn()  # warm-up
    return statistics.median(once(fn, clock) for _ in range(repeats))


def paired_ratio(first: Callable[[], float | None], second: Callable[[], float | None], pairs: int) -> float | None:
    """The median of first() / second() over `pairs` alternations after a warm-up pair (each returns seconds,
    or None on a rank that does not measure): measured a fraction of a second apart, the machine's drift
    (more than 10 % within minutes here) cancels out."""
    ratios = []
    for index in range(pairs + 1):
        a, b = first(), second()
        if index and a is not None and b is not None:
            ratios.append(a / b)
    return statistics.median(ratios) if ratios else None


def line_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope. When noise makes the slope <= 0, the slope is that of the largest
    point through the origin (a conservative bandwidth); the intercept is clamped at 1 ns."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    if slope <= 0:
        slope = ys[-1] / xs[-1]
    return max(my - slope * mx, 1e-9), slope


def relative_fit(sizes: list[int], times: list[float]) -> tuple[float, float]:
    """Intercept and slope of `times` over `sizes`, least squares in relative error (each point weighs
    1/time², so that small micro-batches count as much as large ones); the slope is kept positive."""
    weights = [1.0 / t**2 for t in times]
    sw = sum(weights)
    mx = sum(w * x for w, x in zip(weights, sizes)) / sw
    my = sum(w * y for w, y in zip(weights, times)) / sw
    slope = sum(w * (x - mx) * (y - my) for w, x, y in zip(weights, sizes, times))
    slope /= sum(w * (x - mx) ** 2 for w, x in zip(weights, sizes))
    slope = max(slope, 0.25 * times[-1] / sizes[-1])
    return max(my - slope * mx, 0.0), slope


def reference_model(shape: LayerShape) -> TransformerClassifier:
    """The reference Transformer with the planned layer (`shape`, dropout 0.1 unless given): its `layer()`
    and `head()` are what is timed, `config_blocks(...)[1]` the layer's analytic cost."""
    return TransformerClassifier(TransformerConfig(vocab_size=2, nlayers=1, **{"dropout": 0.1, **shape}))

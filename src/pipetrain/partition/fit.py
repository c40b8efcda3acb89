"""Fit one profile over several micro-batch sizes: each block's cost = a fixed part + a part per sample (pure).

Least squares in relative error (each point weighs 1/value², so that the small micro-batches, where the
fixed part shows, count as much as the large ones). Neither part is negative: a negative intercept is
refitted through the origin, a negative slope replaced by a flat cost.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from pipetrain.errors import ConfigError
from pipetrain.partition.profile import BlockProfile, ModelProfile

__all__ = ["fit_line", "fit_profiles"]


def fit_line(sizes: Sequence[float], values: Sequence[float]) -> tuple[float, float]:
    """(fixed, per_sample) >= 0 with value ≈ fixed + per_sample * size, in relative least squares."""
    if len(sizes) != len(values) or len(sizes) < 2:
        raise ValueError("fit_line needs two or more (size, value) points")
    weights = [1.0 / max(v, 1e-12) ** 2 for v in values]
    total = sum(weights)
    mx = sum(w * x for w, x in zip(weights, sizes)) / total
    my = sum(w * y for w, y in zip(weights, values)) / total
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(weights, sizes))
    slope = sum(w * (x - mx) * (y - my) for w, x, y in zip(weights, sizes, values)) / sxx
    fixed = my - slope * mx
    if slope < 0:  # no cost grows slower than flat
        return my, 0.0
    if fixed < 0:  # through the origin: minimise sum w (y - s x)^2
        return 0.0, sum(w * x * y for w, x, y in zip(weights, sizes, values)) / sum(
            w * x * x for w, x in zip(weights, sizes))
    return fixed, slope


def _fit_block(measured: Sequence[BlockProfile], sizes: Sequence[int], reference: int) -> BlockProfile:
    def fitted(name: str) -> tuple[float, float]:
        fixed, slope = fit_line(sizes, [getattr(b, name) for b in measured])
        return fixed, fixed + slope * reference

    forward_fixed, forward = fitted("forward_s")
    backward_fixed, backward = fitted("backward_s")
    activation_fixed, activation = fitted("activation_bytes")
    outputs = [b.output_bytes / n for b, n in zip(measured, sizes)]

    def optional(name: str) -> tuple[int, int | None]:  # (fixed, at reference) of a field some versions leave out
        if any(getattr(b, name) is None for b in measured):
            return 0, None
        fixed, value = fitted(name)
        return round(fixed), round(value)

    selective_fixed, selective = optional("selective_bytes")
    working_fixed, working = optional("backward_bytes")
    return replace(measured[0], forward_s=forward, backward_s=backward, forward_fixed_s=forward_fixed,
                   selective_bytes=selective, selective_fixed_bytes=selective_fixed,
                   backward_bytes=working, backward_fixed_bytes=working_fixed,
                   backward_fixed_s=backward_fixed, activation_bytes=round(activation),
                   activation_fixed_bytes=round(activation_fixed),
                   output_bytes=round(max(outputs) * reference))


def fit_profiles(profiles: Sequence[ModelProfile], reference: int | None = None) -> ModelProfile:
    """One profile from `profiles` of the same model at different micro-batch sizes, its costs fitted per
    block and given at `reference` samples (default: the largest size measured)."""
    ordered = sorted(profiles, key=lambda p: p.micro_batch_size)
    sizes = [p.micro_batch_size for p in ordered]
    if len(set(sizes)) != len(sizes) or len(sizes) < 2:
        raise ConfigError(f"a fit needs two or more different micro-batch sizes, got {sizes}",
                          hint="measure at sizes such as 1, 2, 4, 8")
    first = ordered[0]
    if any(p.fingerprint != first.fingerprint or p.num_blocks != first.num_blocks for p in ordered):
        raise ConfigError("the profiles to fit are of different models", hint="profile one model at several sizes")
    reference = sizes[-1] if reference is None else reference
    blocks = tuple(_fit_block([p.blocks[i] for p in ordered], sizes, reference) for i in range(first.num_blocks))
    return replace(first, micro_batch_size=reference, blocks=blocks, sizes=tuple(sizes))

"""The planner's memory terms of a pipeline stage beyond its blocks' saved activations (pure): the outputs torch's
stage holds from each forward to its backward, what a block's backward holds at once as it starts, and a per-block
recomputation's peak at the recomputed block (the blocks after it freed). Measured beside the plan by
benchmarks/memory_modes.py (docs/memory.md)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipetrain.plan.hardware import DEFAULT_NETWORK, default_device
from pipetrain.plan.model import BlockCost
from pipetrain.plan.predict import Layout, stage_costs

DEVICE = replace(default_device("fp32"), activation_factor=1.0)
BOUNDS = [(0, 2), (2, 4)]


def _blocks(work: float = 0.0) -> list[BlockCost]:
    return [BlockCost(name=f"B{i}", params=10, param_bytes=40.0, activation_bytes=100.0 + i, output_bytes=10.0,
                      backward_bytes=work * (i + 1)) for i in range(4)]


def _costs(blocks, **options):
    layout = Layout(dp=1, pp=2, batch=8, chunks=4, **options)  # 2 samples a micro-batch
    return stage_costs(blocks, layout, DEVICE, DEFAULT_NETWORK, BOUNDS)


def test_a_middle_stage_holds_its_outputs_with_its_activations():
    first, last = _costs(_blocks())
    assert first.activation_bytes == pytest.approx(2 * (100 + 101 + 10))  # blocks 0, 1 and the output
    assert last.activation_bytes == pytest.approx(2 * (102 + 103))  # the logits are plan/loss.py's
    whole = _costs(_blocks(), checkpoint="always")[0]  # recomputing the stage keeps its input (none) and output
    assert (whole.held_bytes, whole.recompute_bytes) == (pytest.approx(20.0), pytest.approx(2 * (201 + 10)))


def test_a_backward_holds_its_working_bytes_as_it_starts():
    first = _costs(_blocks(work=30.0))[0]
    # block 1 (the stage's last) works 60 a sample beside everything; block 0's 30 comes after block 1 freed 101
    assert first.transient_bytes == pytest.approx(2 * 60.0)
    assert _costs(_blocks(work=300.0))[0].transient_bytes == pytest.approx(2 * max(600.0, 300.0 - 101))


def test_per_block_recomputation_peaks_at_the_recomputed_block_with_the_later_ones_freed():
    blocks = _blocks(work=5.0)
    first = _costs(blocks, checkpoint="always", recompute_unit="layer", recompute_every=2)[0]
    # block 1 recomputes (keeps its input, block 0's output); block 0 keeps all; the output is held
    held = 2 * (100 + 10 + 10)
    assert first.held_bytes == pytest.approx(held)
    assert first.recompute_bytes == pytest.approx(2 * (100 + 101 + 10 + 10))  # block 1 back, working 10
    later = _costs(blocks, checkpoint="always", recompute_unit="layer", recompute_every=1)[0]
    # both recompute (block 0 keeps nothing: the stage input is no tensor here); each peaks alone, not both at once
    assert later.recompute_bytes == pytest.approx(2 * max(0 + 101 + 10 + 10, 100 + 10 + 5))

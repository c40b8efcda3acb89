"""External validation: `pipetrain plan --model` of Llama 3.1 405B beside torchtitan's published H100 figures
(docs/performance.md of pytorch/torchtitan at 9dec370, now benchmarks/llama3_h100_202412_torchtitan.md; Table 5: 512 H100 96 GB, FSDP 8 × TP 8 × PP 8, local batch 32, global
256, full recomputation, bf16 with Float8 linears, torch.compile, async TP). See docs/planning.md for what is
assumed; the planned layouts are torchtitan's defaults at the commit it names (8 micro-batches = pp, 2 stages per
rank for the interleaved schedule, seq len 8192)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipetrain.cli.main import build_parser
from pipetrain.cli.plan import planned

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "benchmarks" / "models" / "llama-3.1-405b" / "config.json"
#: torchtitan's Table 5: tokens/s per GPU and memory (GiB, the peak the allocator reserved, the most of any rank)
PUBLISHED = {"1f1b": (100, 82.5), "interleaved-1f1b": (128, 72.7)}
ARGV = ["plan", "--model", str(CONFIG), "--seq-len", "8192", "--nodes", "64", "--gpus-per-node", "8",
        "--gpu-mem", "95", "--tp", "8", "--pp", "8", "--sequence-parallel", "on", "--dp-modes", "fsdp",
        "--checkpoints", "always", "--batch", "256", "--chunks", "8", "--stages-per-rank", "2",
        "--schedules", "1f1b,interleaved-1f1b", "--precision", "bf16", "--float8", "--recompute-unit", "layer",
        "--vocab-parallel", "--keep-outputs", "--gpu", "h100-sxm"]


@pytest.fixture(scope="module")
def predicted():
    args = build_parser(ARGV).parse_args(ARGV)
    result, _ = planned(args)
    by_schedule = {p.layout.schedule: p for p in result.best + result.too_big}
    assert set(by_schedule) == set(PUBLISHED)
    return by_schedule


def test_the_interleaved_to_1f1b_throughput_ratio_within_10_percent(predicted):
    ratio = predicted["1f1b"].step_s / predicted["interleaved-1f1b"].step_s
    assert ratio == pytest.approx(128 / 100, rel=0.10)


def test_interleaved_peak_memory_within_10_percent(predicted):
    """Planned 79.4 GiB on the last rank (+9.2 %): as its last loss backward starts (plan/loss.py)."""
    assert max(predicted["interleaved-1f1b"].memory_bytes) / 2**30 == pytest.approx(72.7, rel=0.10)


@pytest.mark.xfail(strict=True, reason="known miss: 69.4 GiB planned for 1F1B, 16 % under torchtitan's 82.5 with "
                                       "every allocation the planner knows (its Table 6 measured 75.3 for the same "
                                       "allocations, 8 % above the plan); torchtitan reports the caching allocator's "
                                       "reserved bytes, whose slack the planner does not model (docs/memory.md)")
def test_1f1b_peak_memory_within_10_percent(predicted):
    assert max(predicted["1f1b"].memory_bytes) / 2**30 == pytest.approx(82.5, rel=0.10)


def test_the_1f1b_miss_is_the_one_the_docs_state(predicted):
    """69.4 GiB on the last rank, 15.9 % under the published 82.5 (docs/memory.md says why it is left): the step's
    end no longer counts FSDP's gathered weights and unsharded gradients, which torch frees after the last backward
    (-3.8 GiB before the loss's temporaries moved the peak to the last loss backward)."""
    assert 0.83 < max(predicted["1f1b"].memory_bytes) / 2**30 / 82.5 < 0.86


def test_table_6_1f1b_row_with_the_same_allocations_within_10_percent():
    """Kept back to judge the planner: Table 6 of the same page, FSDP 8 × TP 8 × PP 8 (CP 1), 1F1B, local batch 8 of
    32768 tokens, full recomputation: 8 micro-batches of 32768 tokens, as Table 5's 1F1B (4 × 8192), so the same
    allocations (flash attention keeps no s² tensor); torchtitan measured 75.3 GiB there, 7.2 below Table 5's."""
    argv = list(ARGV)
    for flag, value in (("--seq-len", "32768"), ("--batch", "64"), ("--schedules", "1f1b")):
        argv[argv.index(flag) + 1] = value
    result, _ = planned(build_parser(argv).parse_args(argv))
    (prediction,) = result.best + result.too_big
    assert max(prediction.memory_bytes) / 2**30 == pytest.approx(75.3, rel=0.10)


def test_both_peaks_are_the_last_rank(predicted):
    """The terms that set them: the last stage's outputs (fp32 logits, vocabulary-parallel: 1.96 GiB per micro-batch
    on each rank), kept to the step's end, and, as the last micro-batch's loss backward starts, its log-softmax and
    torch's loss_parallel's three temporaries beside them (plan/loss.py)."""
    for schedule in PUBLISHED:
        memory = predicted[schedule].memory_bytes
        assert memory.index(max(memory)) == len(memory) - 1


def test_planning_405b_loads_nothing_and_takes_seconds_at_most():
    code = ("import sys, time; start = time.perf_counter(); from pipetrain.cli.main import main; "
            f"rc = main({ARGV!r}); took = time.perf_counter() - start; "
            "assert rc == 0 and 'torch' not in sys.modules and 'transformers' not in sys.modules, rc; "
            "print(f'PLANNED IN {took:.3f} s')")
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={"PYTHONPATH": str(ROOT / "src"), "PATH": ""},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "PLANNED IN" in out.stdout and time.perf_counter() - start < 5.0  # generous: ~0.6 s measured

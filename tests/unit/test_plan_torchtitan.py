"""External validation: `pipetrain plan --model` of Llama 3.1 405B beside torchtitan's published H100 figures
(docs/performance.md of pytorch/torchtitan, Table 5: 512 H100 96 GB, FSDP 8 × TP 8 × PP 8, local batch 32, global
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
        "--vocab-parallel", "--gpu", "h100-sxm"]


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


def test_interleaved_peak_memory_within_15_percent(predicted):
    assert max(predicted["interleaved-1f1b"].memory_bytes) / 2**30 == pytest.approx(72.7, rel=0.15)


@pytest.mark.xfail(strict=True, reason="known miss: the plan holds 60.8 GiB where torchtitan reports 82.5 GiB "
                                       "reserved for 1F1B (-26 %); see docs/planning.md")
def test_1f1b_peak_memory_within_15_percent(predicted):
    assert max(predicted["1f1b"].memory_bytes) / 2**30 == pytest.approx(82.5, rel=0.15)


def test_1f1b_is_predicted_below_the_published_peak_not_above(predicted):
    """What the miss is: the plan counts allocated bytes, torchtitan the allocator's reserved peak."""
    assert 0.70 * 82.5 < max(predicted["1f1b"].memory_bytes) / 2**30 < 82.5


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

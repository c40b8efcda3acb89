"""External validation: `pipetrain plan --model` of Llama 3.1 405B beside torchtitan's published H100 figures
(docs/performance.md of pytorch/torchtitan at 9dec370, now benchmarks/llama3_h100_202412_torchtitan.md; Table 5: 512 H100 96 GB, FSDP 8 × TP 8 × PP 8, local batch 32, global
256, full recomputation, bf16 with Float8 linears, torch.compile, async TP). See docs/planning.md for what is
assumed; the planned layouts are torchtitan's defaults at the commit it names (8 micro-batches = pp, 2 stages per
rank for the interleaved schedule, `generate_split_points`' layers per stage, seq len 8192), and its model's bf16
logits kept by the schedule (its loss casts a copy to fp32: `--bf16-logits`)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipetrain.cli.main import build_parser
from pipetrain.cli.plan import planned
from pipetrain.errors import ConfigError
from pipetrain.plan.transformer import read_config, sizes_from_config

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "benchmarks" / "models" / "llama-3.1-405b" / "config.json"
#: torchtitan's Table 5: tokens/s per GPU and memory (GiB, the peak the allocator reserved, the most of any rank)
PUBLISHED = {"1f1b": (100, 82.5), "interleaved-1f1b": (128, 72.7)}
ARGV = ["plan", "--model", str(CONFIG), "--seq-len", "8192", "--nodes", "64", "--gpus-per-node", "8",
        "--gpu-mem", "95", "--tp", "8", "--pp", "8", "--sequence-parallel", "on", "--dp-modes", "fsdp",
        "--checkpoints", "always", "--batch", "256", "--chunks", "8", "--stages-per-rank", "2",
        "--schedules", "1f1b,interleaved-1f1b", "--precision", "bf16", "--float8", "--recompute-unit", "layer",
        "--loss-parallel", "--keep-outputs", "--bf16-logits", "--gpu", "h100-sxm"]
#: why torchtitan's two published 1F1B figures stay out of 10 % (docs/memory.md, "Llama 3.1 405B")
RESERVE = ("every allocation the planner knows at torchtitan's settings (read at 9dec370) plans 61.8 GiB; torchtitan "
           "reports the caching allocator's reserved peak, and its two 1F1B figures for the same allocations differ "
           "by 7.2 GiB (Table 5: 82.5, Table 6: 75.3); no reserve factor is tuned to them")


@pytest.fixture(scope="module")
def predicted():
    args = build_parser(ARGV).parse_args(ARGV)
    result, _ = planned(args)
    by_schedule = {p.layout.schedule: p for p in result.best + result.too_big}
    assert set(by_schedule) == set(PUBLISHED)
    return by_schedule


def test_bf16_logits_halve_the_kept_outputs_not_the_log_softmax():
    """`--bf16-logits`: the head outputs 2 bytes per logit (torchtitan's model), its loss's log-softmax stays fp32."""
    sizes = sizes_from_config(read_config(CONFIG)[0])
    fp32, bf16 = sizes.blocks(8192)[-1], sizes.blocks(8192, logits_element=2)[-1]
    assert bf16.output_bytes == fp32.output_bytes / 2 == 2 * 8192 * 128256
    assert bf16.loss_bytes == fp32.loss_bytes == 4 * 8192 * 128256
    argv = [a for a in ARGV if a != "--float8"]
    argv[argv.index("--precision") + 1] = "fp32"
    with pytest.raises(ConfigError, match="--bf16-logits"):
        planned(build_parser(argv).parse_args(argv))


def test_the_interleaved_to_1f1b_throughput_ratio_within_10_percent(predicted):
    ratio = predicted["1f1b"].step_s / predicted["interleaved-1f1b"].step_s
    assert ratio == pytest.approx(128 / 100, rel=0.10)


def test_interleaved_peak_memory_within_10_percent(predicted):
    """Planned 70.6 GiB on the last rank (-2.9 %): as its last loss backward starts (plan/loss.py)."""
    assert max(predicted["interleaved-1f1b"].memory_bytes) / 2**30 == pytest.approx(72.7, rel=0.10)


@pytest.mark.xfail(strict=True, reason="known miss, 25 % under the published 82.5: " + RESERVE)
def test_1f1b_peak_memory_within_10_percent(predicted):
    assert max(predicted["1f1b"].memory_bytes) / 2**30 == pytest.approx(82.5, rel=0.10)


def test_the_1f1b_miss_is_the_one_the_docs_state(predicted):
    """61.8 GiB on pipeline rank 1, 25 % under the published 82.5 (docs/memory.md says why it is left): was 69.4 on
    the last rank before its kept logits were counted in bf16, as torchtitan's model returns them (-7.8 GiB)."""
    assert 0.74 < max(predicted["1f1b"].memory_bytes) / 2**30 / 82.5 < 0.76


def _table_6(cp: int = 1) -> float:
    """Kept back to judge the planner: Table 6 of the same page, FSDP 8 × TP 8 × PP 8 (CP 1), 1F1B, local batch 8 of
    32768 tokens, full recomputation: 8 micro-batches of 32768 tokens, as Table 5's 1F1B (4 × 8192), so the same
    allocations (flash attention keeps no s² tensor); torchtitan measured 75.3 GiB there, 7.2 below Table 5's.
    `cp`: its CP rows, FSDP 8 / cp, sequences of 32768 × cp tokens, sequence parallelism beside CP."""
    argv = list(ARGV) + (["--cp", str(cp)] if cp > 1 else [])
    for flag, value in (("--seq-len", str(32768 * cp)), ("--batch", str(64 // cp)), ("--schedules", "1f1b")):
        argv[argv.index(flag) + 1] = value
    result, _ = planned(build_parser(argv).parse_args(argv))
    (prediction,) = result.best + result.too_big
    return max(prediction.memory_bytes) / 2**30


@pytest.mark.xfail(strict=True, reason="known miss, 18 % under the published 75.3: " + RESERVE)
def test_table_6_1f1b_row_with_the_same_allocations_within_10_percent():
    assert _table_6() == pytest.approx(75.3, rel=0.10)


def test_table_6_plans_what_table_5_1f1b_plans(predicted):
    """The same allocations plan the same peak (61.8 GiB, 0.820 of Table 6's 75.3; 0.749 of Table 5's 82.5)."""
    assert _table_6() == pytest.approx(max(predicted["1f1b"].memory_bytes) / 2**30, rel=1e-3)
    assert 0.81 < _table_6() / 75.3 < 0.83


@pytest.mark.parametrize("cp, published", [(2, 75.9), (4, 77.1)])
def test_table_6_cp_rows_plan_sequence_parallelism_beside_cp(cp, published):
    """Table 6's CP rows (TP 8 with sequence parallelism beside CP 2 and 4) are planned, not refused: a rank holds
    the same 32768 tokens of a sequence as at CP 1, so the same peak (61.8 GiB: 0.814 and 0.801 of the published
    figures, below them as every planned row; nothing tuned to them)."""
    assert _table_6(cp) == pytest.approx(_table_6(), rel=1e-3)
    assert 0.79 < _table_6(cp) / published < 0.82


def test_where_the_peaks_are(predicted):
    """Interleaved: the last rank, set by the last stage's outputs (bf16 logits, vocabulary-parallel: 0.98 GiB per
    micro-batch on each rank) kept to the step's end and, as the last micro-batch's loss backward starts, its fp32
    log-softmax and torch's loss_parallel's three temporaries beside them (plan/loss.py). 1F1B: pipeline rank 1 (16
    layers' weights and fp32 gradients, 7 micro-batches' layer inputs and stage outputs in flight), 2.2 GiB above
    the last rank (whose outputs torch's stage holds for the backward are the very tensors its schedule keeps:
    counted once)."""
    interleaved, one = predicted["interleaved-1f1b"].memory_bytes, predicted["1f1b"].memory_bytes
    assert interleaved.index(max(interleaved)) == len(interleaved) - 1
    assert one.index(max(one)) == 1 and max(one) - one[-1] == pytest.approx(2.2 * 2**30, rel=0.1)


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


LLAMA_8B = ROOT / "benchmarks" / "models" / "llama-3.1-8b" / "config.json"
H100_PP1 = ["--gpu", "h100-sxm", "--gpu-mem", "95", "--precision", "bf16", "--gpus-per-node", "8", "--tp", "1",
            "--dp-modes", "fsdp", "--pp", "1", "--chunks", "1", "--fsdp-reshard", "always", "--bf16-logits"]


@pytest.mark.parametrize("gpus, batch, seq, options, published", [
    # Tables 1 and 3: local batch 2 x 8192, torchtitan's selective op policy (every other matrix product kept)
    (8, 16, 8192, ["--checkpoints", "always", "--recompute-unit", "selective", "--selective-matmuls", "alternate"],
     82.4),
    (128, 256, 8192, ["--checkpoints", "always", "--recompute-unit", "selective", "--selective-matmuls", "alternate"],
     67.0),
    # Table 2: one sequence a rank, split over cp 2, full recomputation, Float8
    (8, 4, 65536, ["--cp", "2", "--checkpoints", "always", "--recompute-unit", "layer", "--float8"], 84.2),
])
def test_torchtitans_8b_rows_below_their_reserved_peak(gpus, batch, seq, options, published):
    """Kept back while the 405B rows were studied: torchtitan's 8B rows of the same page (docs/memory.md). The plan
    counts allocated bytes, torchtitan reports its caching allocator's reserved peak (the allocated bytes plus the
    cached, split blocks): the plan must not exceed it, and stays within 15 % of it (it reads 11-12 % under: the
    reserve is not modelled, no factor is tuned to these rows)."""
    argv = ["plan", "--model", str(LLAMA_8B), "--gpus", str(gpus), "--batch", str(batch), "--seq-len", str(seq),
            *H100_PP1, *options]
    result, _ = planned(build_parser(argv).parse_args(argv))
    (only,) = result.best + result.too_big
    assert 0.85 * published < max(only.memory_bytes) / 2**30 < published

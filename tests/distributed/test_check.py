"""`pipetrain check` on real layouts: it passes every built-in workload over each layout family, and fails,
naming the block, on models that cannot train the same split (batch statistics, hidden Python-side state).

All the layouts of world size 2 run on one spawned job (`run_checks`); the references run in this process.
`examples/my_model.py` is among them, named by its file path (each rank loads the file).
The tolerances are the check's own (pipetrain.check.TOLERANCES): what is tested is its verdict.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from pipetrain.check import run_checks
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.train.loop import TrainConfig, load_data

MODELS = "tests.distributed.check_models"
EXAMPLE = f"{Path(__file__).resolve().parents[2] / 'examples' / 'my_model.py'}:workload"  # file.py:NAME
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def _config(workload: str, preset: str = "tiny", *, pp: int = 2, dp: int = 1, dp_mode: str = "ddp",
            schedule: str = "1f1b", chunks: int = 4, checkpoint: str = "never", stages: int | None = None,
            precision: str = "fp32", batch: int = 8, tp: int = 1) -> TrainConfig:
    pipeline = PipelineConfig(pp=pp, schedule=schedule, n_microbatches=chunks, checkpoint=checkpoint,
                              stages_per_rank=stages)
    return TrainConfig(parallel=ParallelConfig(dp=dp, dp_mode=dp_mode, pipeline=pipeline, tp=tp), workload=workload,
                       preset=preset, data="synthetic", train_samples=batch * 2, test_samples=batch, batch_size=batch,
                       epochs=1, precision=precision, progress=False)


CASES = {
    "classifier-pp2-gpipe": _config("classifier", schedule="gpipe"),
    "classifier-pp2-interleaved": _config("classifier", schedule="interleaved-1f1b", stages=2),
    "classifier-pp2-1f1b-bf16": _config("classifier", precision="bf16"),
    "lm-pp2-1f1b-recompute": _config("lm", checkpoint="except_last"),
    "lm-dp2-ddp": _config("lm", pp=1, dp=2, schedule="gpipe", chunks=2),
    "lm-dp2-fsdp": _config("lm", pp=1, dp=2, dp_mode="fsdp", schedule="gpipe", chunks=2),
    "lm-tp2": _config("lm", pp=1, tp=2, schedule="gpipe", chunks=2),
    "example-file-pp2-1f1b": _config(EXAMPLE),
    "toy-hazards-pp2": _config(f"{MODELS}:hazards"),
    "toy-batch-stat-pp2": _config(f"{MODELS}:batch_stat"),
    "toy-counter-pp2": _config(f"{MODELS}:counter", schedule="gpipe"),
}
if HAS_TRANSFORMERS:
    CASES["hf-llama-pp2-1f1b"] = _config("hf", "llama-tiny")
    CASES["hf-llama-tp2"] = _config("hf", "llama-tiny", pp=1, tp=2, schedule="gpipe", chunks=2)
PASSING = [name for name in CASES if "batch-stat" not in name and "counter" not in name]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    jobs = [(config, load_data(config)[0]) for config in CASES.values()]
    return dict(zip(CASES, run_checks(jobs, steps=2, work_dir=tmp_path_factory.mktemp("check"))))


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.bf16) if "bf16" in name else name
                                  for name in PASSING])
def test_passes_on_sound_models(name, reports):
    report = reports[name]
    text = "\n".join(report.lines())
    assert report.passed, text
    assert text.splitlines()[-1].startswith("PASS"), text
    worst = max(max(d.grad for d in step.blocks.values()) for step in report.steps)
    assert 0 < worst <= report.tolerances.grad  # compared for real: round-off shows, within tolerance
    assert "two reference runs: identical" in text


def test_names_the_hazards_that_do_not_fail(reports):
    text = "\n".join(reports["toy-hazards-pp2"].lines())
    assert "dropout: block 2 (Hazardous): switched off" in text and "dropout p=0.5" in text
    assert "buffer outside the state dict: block 2 (Hazardous): scale" in text
    assert "tensor outside parameters and buffers: block 2 (Hazardous): offset" in text
    assert "parameter never used: block 2 (Hazardous): 2.unused.weight" in text


def test_fails_naming_the_block_with_batch_statistics(reports):
    report = reports["toy-batch-stat-pp2"]
    text = "\n".join(report.lines())
    assert not report.passed and "FAIL" in text
    assert "likely cause: batch statistics: block 2 (BatchMean)" in text, text


def test_fails_naming_the_block_with_hidden_state(reports):
    report = reports["toy-counter-pp2"]
    text = "\n".join(report.lines())
    assert not report.passed and "FAIL" in text
    assert "likely cause: hidden state: block 2 (Counter)" in text, text


def test_a_file_workload_is_checked_block_by_block(reports):
    text = "\n".join(reports["example-file-pp2-1f1b"].lines())
    assert "balance 3,3" in text and "0 Embed" in text and "5 Linear" in text
    assert text.splitlines()[-1].startswith("PASS: every loss, gradient and parameter of 2 step(s)")


@pytest.mark.bf16
def test_bf16_is_judged_with_the_looser_tolerances(reports):
    report = reports["classifier-pp2-1f1b-bf16"]
    assert report.precision == "bf16" and report.tolerances.grad > 1e-3
    assert "tolerances (bf16)" in "\n".join(report.lines())


# tensors sharded over tp (row-parallel and fused biases are replicated): lm 5 per layer (qkv, proj, mlp.0 weight
# and bias, mlp.2), Llama 7 (its projections); the classifier's TP parity is test_tp_parity's
@pytest.mark.parametrize(("name", "split"), [("lm-tp2", 5 * 4), ("hf-llama-tp2", 7 * 4)])
def test_tensor_parallel_layouts_are_checked_split(name, split, reports):
    """`check --tp 2` runs the layout with the model's TP plan applied (and says how much it split)."""
    if name not in reports:
        pytest.skip("transformers is not installed")
    text = "\n".join(reports[name].lines())
    assert "x pp=1 x tp=2" in text, text
    assert f"tensor parallel: {split} of " in text and "split over tp=2" in text, text

"""The one-GPU tier: `pipetrain train` at pp=1 on CUDA (fp32 with TF32 and strict, bf16, recomputation), save and
resume with the CUDA generator restored, CUDA checkpoints loaded on the CPU and the reverse, an OOM reported as
such under a memory limit, and the refusal of two ranks on one GPU. Skipped without CUDA.

The jobs train the `cpu` preset (dropout 0.1, so the resumed losses equal the uninterrupted run's only if the CUDA
dropout stream is restored) on 192 synthetic reviews, batch 16: 12 steps, a checkpoint every 4. Same device, same
layout: the epoch report within 1e-5 relative (CUDA kernels such as the embedding's backward may sum in another
order; a dropout stream replayed from its start moves the losses by about 1e-2).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

RTOL = 1e-5
ARGS = ["--pp", "1", "--chunks", "2", "--preset", "cpu", "--data", "synthetic", "--train-samples", "192",
        "--test-samples", "32", "--batch-size", "16", "--epochs", "1", "--no-progress"]


def _train(*extra: str, device: str = "cuda", timeout: float = 300) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pipetrain", "train", *ARGS, "--device", device, *extra]
    env = {k: v for k, v in os.environ.items() if k != "PIPETRAIN_DEVICE"}  # --device decides, not the tier's pin
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False, env=env)


def _losses(path: Path) -> list[tuple[float, float]]:
    return [(r["train_loss"], r["test_loss"]) for r in json.loads(path.read_text())]


def _metrics(tmp_path: Path, name: str, *extra: str, device: str = "cuda") -> list[tuple[float, float]]:
    out = tmp_path / f"{name}.json"
    done = _train("--metrics", str(out), "--run-dir", str(tmp_path / f"run-{name}"), *extra, device=device)
    assert done.returncode == 0, done.stderr
    return _losses(out)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted CUDA job, saving every 4 steps into <folder>/ckpt; its report in <folder>/metrics.json."""
    folder = tmp_path_factory.mktemp("reference")
    done = _train("--save-dir", str(folder / "ckpt"), "--save-every", "4", "--keep", "all",
                  "--metrics", str(folder / "metrics.json"), "--run-dir", str(folder / "run"))
    assert done.returncode == 0, done.stderr
    return folder


def _from_step(reference: Path, step: int, target: Path) -> Path:
    target.mkdir(parents=True)
    shutil.copytree(reference / "ckpt" / f"step-{step:08d}", target / f"step-{step:08d}")
    return target


@pytest.mark.parametrize("extra", [[], ["--precision", "fp32-strict"], ["--precision", "bf16"],
                                   ["--checkpoint", "always"]], ids=["fp32-tf32", "fp32-strict", "bf16", "recompute"])
def test_pp1_trains_on_cuda(tmp_path, extra):
    (train_loss, test_loss), = _metrics(tmp_path, "run", *extra)
    assert 0 < train_loss < 10 and 0 < test_loss < 10


def test_strict_fp32_on_cuda_matches_the_cpu(tmp_path):
    cuda = _metrics(tmp_path, "cuda", "--precision", "fp32-strict")
    cpu = _metrics(tmp_path, "cpu", device="cpu")
    assert cuda == pytest.approx(cpu, rel=1e-3)  # different kernels, same fp32 arithmetic up to summation order


def test_resume_on_cuda_restores_the_dropout_stream(reference, tmp_path):
    save_dir = _from_step(reference, 4, tmp_path / "ckpt")
    resumed = _metrics(tmp_path, "resumed", "--save-dir", str(save_dir), "--resume")
    assert resumed == pytest.approx(_losses(reference / "metrics.json"), rel=RTOL)


def test_a_cuda_checkpoint_resumes_on_the_cpu_and_the_reverse(reference, tmp_path):
    on_cpu = _metrics(tmp_path, "on-cpu", "--save-dir", str(_from_step(reference, 8, tmp_path / "a")), "--resume",
                      device="cpu")
    assert on_cpu == pytest.approx(_losses(reference / "metrics.json"), rel=0.1)  # other device: other dropout streams, other kernels
    cpu_dir = tmp_path / "cpu-ckpt"
    _metrics(tmp_path, "cpu-first", "--save-dir", str(cpu_dir), "--max-steps", "4", device="cpu")
    back = _metrics(tmp_path, "back", "--save-dir", str(cpu_dir), "--resume")
    assert all(0 < value < 10 for pair in back for value in pair)


def test_oom_under_a_memory_limit_is_reported_as_oom(tmp_path):
    out = tmp_path / "bench"
    command = [sys.executable, "-m", "pipetrain", "bench", "--device", "cuda", "--grid", "pp=1", "--grid", "batch=256",
               "--grid", "chunks=1", "--grid", "preset=cpu", "--mem-limit", "16", "--warmup", "0", "--steps", "1",
               "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    cells = [json.loads(line) for line in (out / "cells.jsonl").read_text().splitlines()]
    assert [c["status"] for c in cells] == ["oom"], cells
    assert "out of memory" in cells[0]["reason"]


@pytest.mark.skipif(torch.cuda.device_count() != 1, reason="needs exactly one GPU")
def test_two_ranks_on_one_gpu_are_refused_with_one_message(tmp_path):
    done = _train("--pp", "2", "--run-dir", str(tmp_path / "run"))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "2 ranks on this node but it has 1 GPU(s)" in lines[0], done.stderr

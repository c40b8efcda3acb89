"""`pipetrain train --objective dpo|grpo` end to end on 2 gloo ranks (pp2), LoRA on a tiny Llama folder.

DPO: job A trains 2 steps on 36 preference pairs and saves (the reference log-probs, computed through the pipeline with
the adapters off, stored beside the checkpoints); job B resumes it to step 4 and reads the stored table (its file is
not written again); `steps.jsonl` holds TRL's rewards/* figures at every step; `pipetrain eval` of the checkpoint
(the reference recomputed from the base before the adapters are loaded) gives the held-out loss and preference
accuracy of B's last evaluation. GRPO, beside job A: 2 steps of 2 prompts x 2 completions, 2 iterations per
generation batch, KL to the base: the step records hold the reward, its std, the exact-match function's mean, the
completion length, the KL and the clip share, and the log shows a sampled completion with its reward; its held-out
evaluation is the reward of greedy completions of the held-out prompts, with no loss.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from pipetrain.logs.jsonl import read_records  # noqa: E402
from tests.distributed.train_jobs import finish, start_train  # noqa: E402
from tests.hf_folders import tiny_model_folder  # noqa: E402

COMMON = ["--workload", "hf", "--pp", "2", "--chunks", "2", "--seq-len", "32", "--lora-rank", "4", "--lr", "1e-3",
          "--no-progress", "--log-every", "1"]
REWARD = '''
def exact(prompts, completions, answer, **kwargs):
    return [1.0 if c.strip().rstrip(".") == a else 0.0 for c, a in zip(completions, answer)]
'''


def _data(root: Path) -> tuple[Path, Path]:
    rng = random.Random(0)
    sums = [(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(40)]
    pairs, prompts = root / "pairs.jsonl", root / "sums.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"{a} plus {b} is", "chosen": f" {a + b}.",
                                         "rejected": f" {a + b + 1}."}) + "\n" for a, b in sums))
    prompts.write_text("".join(json.dumps({"prompt": f"{a} plus {b} is", "answer": str(a + b)}) + "\n"
                               for a, b in sums))
    (root / "sum_reward.py").write_text(REWARD)
    return pairs, prompts


@pytest.mark.timeout(1500)  # four launches of 2 ranks (three at once at most)
def test_dpo_resumes_with_its_stored_reference_and_grpo_rolls_out(tmp_path):
    model = tiny_model_folder(tmp_path / "model", layers=2)
    pairs, prompts = _data(tmp_path)
    dpo = [*COMMON, "--model", str(model), "--data", str(pairs), "--objective", "dpo", "--dpo-beta", "0.5",
           "--batch-size", "4", "--save-dir", str(tmp_path / "ck"), "--save-every", "2"]
    a = start_train(*dpo, "--max-steps", "2", "--run-dir", str(tmp_path / "a"))
    grpo = start_train(*COMMON, "--model", str(model), "--data", str(prompts), "--objective", "grpo", "--reward",
                       f"{tmp_path / 'sum_reward.py'}:exact", "--num-generations", "2", "--batch-size", "4",
                       "--grpo-iterations", "2", "--kl-beta", "0.05", "--max-completion-length", "4",
                       "--max-steps", "2", "--run-dir", str(tmp_path / "g"), merge_stderr=True)
    finish(a, timeout=600)
    table = tmp_path / "ck" / "reference-logps.pt"
    written = table.stat().st_mtime_ns
    b = start_train(*dpo, "--max-steps", "4", "--resume", "--run-dir", str(tmp_path / "b"))
    out = finish(grpo, timeout=600)
    finish(b, timeout=600)
    assert table.stat().st_mtime_ns == written  # read, not recomputed
    steps = read_records(tmp_path / "a" / "steps.jsonl", "step") + read_records(tmp_path / "b" / "steps.jsonl", "step")
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for record in steps:
        assert record["rewards/margins"] == pytest.approx(record["rewards/chosen"] - record["rewards/rejected"])
        assert 0 <= record["rewards/accuracies"] <= 1 and record["accuracy"] == record["rewards/accuracies"]
    assert steps[0]["loss"] == pytest.approx(0.6931471805599453)  # the policy is the reference at step 1
    last = read_records(tmp_path / "b" / "steps.jsonl", "eval")[-1]
    figures = tmp_path / "eval.json"
    subprocess.run([sys.executable, "-m", "pipetrain", "eval", "--checkpoint", str(tmp_path / "ck"), "--data",
                    str(pairs), "--pp", "2", "--batch-size", "4", "--out", str(figures)], check=True,
                   capture_output=True, text=True, timeout=600)
    measured = json.loads(figures.read_text())
    assert measured["loss"] == pytest.approx(last["loss"], rel=1e-6)
    assert measured["preference_accuracy"] == pytest.approx(last["accuracy"])
    rollouts = read_records(tmp_path / "g" / "steps.jsonl", "step")
    assert len(rollouts) == 2
    for record in rollouts:
        for name in ("reward", "reward_std", "rewards/exact/mean", "completions/mean_length", "kl",
                     "clip_ratio/region_mean"):
            assert math_ok(record[name]), name
        assert 1 <= record["completions/mean_length"] <= 4
    assert "sample at step 1: " in out and "(reward " in out
    held_out = read_records(tmp_path / "g" / "steps.jsonl", "eval")  # greedy completions of the held-out prompts
    assert [e["step"] for e in held_out] == [2] and held_out[0]["loss"] is None
    assert 0 <= held_out[0]["reward"] <= 1 and held_out[0]["rewards/exact/mean"] == pytest.approx(held_out[0]["reward"])
    assert f"eval at step 2 | reward {held_out[0]['reward']:.4g} | " in out
    assert "held-out reward " in out and "held-out loss" not in out  # the epoch line; no best-loss line


def math_ok(value: float) -> bool:
    return value == value and abs(value) < 1e6

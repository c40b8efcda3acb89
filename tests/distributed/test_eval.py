"""`pipetrain eval` at dp2 × pp2: the held-out loss equals the unsplit transformers model's on the same batches
(rtol 1e-5), and the answer accuracy is what transformers' greedy `generate` gives; the same rows packed by document
(`--pack documents`, at pp2) give the same loss and are still answered.

The data are 80 prompt/answer rows for a tiny Llama (3 layers, wide weights: see test_generate); the held-out
split is every 10th row (8 rows). Half of the held-out rows have as answer the unsplit model's own 3 greedy tokens
for their prompt (decoded), the other half an answer it does not give: the accuracy must be exactly 4/8, which
needs every answer generated through the pipeline to be the unsplit model's (each replica answers 4 of them).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")

from pipetrain.cli import main as cli_main  # noqa: E402
from pipetrain.data.fields import RowFormat  # noqa: E402
from pipetrain.train.config import TrainConfig, load_data  # noqa: E402
from tests.distributed.test_generate import wide_folder  # noqa: E402

SEQ, NEW = 48, 3


def _rows(folder: str) -> list[dict]:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    rows = []
    for index in range(80):
        prompt = f"Review {index}: it was {'the best' if index % 3 else 'the worst'} of times. Verdict:"
        answer = " zebra quartz"
        if index % 10 == 9 and (index // 10) % 2 == 0:  # held out, and answered by the model itself
            ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                                 pad_token_id=0)
            answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        rows.append({"prompt": prompt, "completion": answer})
    return rows


def _unsplit_loss(folder: str, data) -> float:
    config = TrainConfig(workload="hf", model_dir=folder, data=data, seq_len=SEQ, batch_size=4,
                         row_format=RowFormat())
    _, test = load_data(config)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in config.task().batches(test, 4, shuffle=False, seed=0, epoch=0, replica=0, replicas=1):
            logits = model(x).logits  # the targets are the next tokens already (-100: not trained, padding)
            total += F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum").item()
            count += int((y != -100).sum())
    return total / count


def test_eval_loss_and_answer_accuracy_match_the_unsplit_model(tmp_path):
    folder = wide_folder(tmp_path / "llama", "llama")
    data = tmp_path / "sft.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in _rows(folder)) + "\n")
    out = tmp_path / "eval.json"
    assert cli_main.main(["eval", "--model", folder, "--data", str(data), "--seq-len", str(SEQ), "--batch-size", "4",
                          "--dp", "2", "--pp", "2", "--max-new-tokens", str(NEW), "--out", str(out),
                          "--device", "cpu"]) == 0
    figures = json.loads(out.read_text())
    expected = _unsplit_loss(folder, data)
    assert math.isclose(figures["loss"], expected, rel_tol=1e-5), (figures["loss"], expected)
    assert math.isclose(figures["perplexity"], math.exp(expected), rel_tol=1e-4)
    assert (figures["correct"], figures["answers"]) == (4, 8) and figures["answer_accuracy"] == 0.5
    # the rows packed by document (a `--pack documents` run's data): the same loss, and the answers still scored
    # (main skipped them: "the data holds plain text")
    assert cli_main.main(["eval", "--model", folder, "--data", str(data), "--seq-len", str(SEQ), "--batch-size", "4",
                          "--pp", "2", "--pack", "documents", "--max-new-tokens", str(NEW), "--out", str(out),
                          "--device", "cpu"]) == 0
    packed = json.loads(out.read_text())
    assert math.isclose(packed["loss"], expected, rel_tol=1e-5), (packed["loss"], expected)
    assert (packed["correct"], packed["answers"]) == (4, 8)


def test_eval_at_dp2_tp2_ends_when_the_held_out_rows_do_not_divide(tmp_path):
    """18 held-out rows in chunks of 8: replica 0 answers two chunks, replica 1 one. Under FSDP (dp 2 x tp 2) every
    generation gathers the weights over the replicas: replica 1 takes an empty turn, so both gather as often (fails
    on main by hanging; the job is ended by its process group after the timeout)."""
    import os
    import signal
    import subprocess
    import sys

    folder = wide_folder(tmp_path / "llama", "llama")
    rows = [{"prompt": f"Review {index}: it was {'good' if index % 3 else 'bad'}. Verdict:", "completion": " yes"}
            for index in range(180)]
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    out = tmp_path / "eval.json"
    command = [sys.executable, "-m", "pipetrain", "eval", "--model", folder, "--data", str(data), "--seq-len", "32",
               "--batch-size", "8", "--dp", "2", "--tp", "2", "--max-new-tokens", "2", "--out", str(out),
               "--device", "cpu"]
    job = subprocess.Popen(command, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    try:
        printed, _ = job.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        job.communicate()
        pytest.fail("pipetrain eval --dp 2 --tp 2 still ran after 240 s (a replica waits in a gather for good)")
    assert job.returncode == 0, printed
    figures = json.loads(out.read_text())
    assert figures["answers"] == 18 and figures["tokens"] > 0, figures

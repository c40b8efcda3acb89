"""A BatchNorm model from the command line: issue 26's five-block model (block 2 `Linear -> BatchNorm1d -> ReLU`)
through `pipetrain train --workload FILE:NAME --pp 2 --chunks 4 --batch-size 16` to completion (it once died in the
shape run, training mode on a batch of one), its running statistics saved in the checkpoint under layout-free keys
and exported; then `pipetrain export`'s file loads into the unsplit model and evaluates like the job did."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pipetrain.blocks import build_sequential
from pipetrain.cli.main import main
from pipetrain.workloads.loader import load_workload
from pipetrain.workloads.registry import DataRequest

ROOT = Path(__file__).resolve().parents[2]
FILE = ROOT / "tests" / "fixtures" / "batchnorm_workload.py"


def test_train_a_batchnorm_model_from_a_file(tmp_path, capfd):
    metrics, saves, exported = tmp_path / "metrics.json", tmp_path / "ckpt", tmp_path / "model.pt"
    code = main(["train", "--workload", f"{FILE}:workload", "--preset", "tiny", "--pp", "2", "--chunks", "4",
                 "--batch-size", "16", "--train-samples", "64", "--test-samples", "32", "--epochs", "1",
                 "--checkpoint", "except_last", "--deferred-batchnorm", "--no-progress", "--lr", "0.05",
                 "--metrics", str(metrics), "--run-dir", str(tmp_path / "run"), "--save-dir", str(saves)])
    out = capfd.readouterr().out
    assert code == 0, out
    (report,) = json.loads(metrics.read_text())
    assert report["steps"] == 4 and 0 < report["train_loss"] < 5
    assert main(["export", str(saves), str(exported)]) == 0
    state = torch.load(exported, weights_only=True)
    # the running statistics moved once per step (deferred): 4 steps, from the data's mean (about 1 x weights)
    assert state["2.1.num_batches_tracked"].item() == 4
    assert state["2.1.running_mean"].abs().sum() > 0 and not torch.equal(state["2.1.running_var"], torch.ones(24))
    workload = load_workload(f"{FILE}:workload")
    net = build_sequential(workload.model("tiny"), seed=0)
    net.load_state_dict(state)  # every key of the unsplit model, buffers included
    net.eval()
    _, test = workload.load_data(DataRequest(preset="tiny", path=None, synthetic=True, train_samples=64,
                                             test_samples=32, seed=0))  # the job's evaluation set
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(net(test.x), test.y).item()
    assert abs(loss - report["test_loss"]) < 1e-4, (loss, report)

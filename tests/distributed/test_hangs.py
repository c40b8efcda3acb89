"""Hang reports and stragglers through `pipetrain train` (real ranks, gloo): a rank asleep for good in a block is
named by the step watchdog with where it is, every rank's stack is in the run folder (the asleep one's shows the
block's frame); a rank slowed in a block is named as a straggler within one log window, the others not."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipetrain.cli.main import main
from pipetrain.logs.jsonl import read_records

ROOT = Path(__file__).resolve().parents[2]
FILE = ROOT / "tests" / "fixtures" / "slow_block_workload.py"
ARGS = ["--preset", "tiny", "--chunks", "2", "--train-samples", "160", "--test-samples", "16", "--epochs", "1",
        "--no-progress", "--balance", "2,2"]


@pytest.mark.timeout(120)
def test_a_rank_asleep_in_a_block_is_named_with_every_rank_stack(tmp_path, capfd):
    run = tmp_path / "run"
    code = main(["train", "--workload", f"{FILE}:hang", *ARGS, "--pp", "2", "--batch-size", "8",
                 "--step-timeout", "3", "--run-dir", str(run)])
    err = capfd.readouterr().err
    assert code != 0
    assert err.count("pipetrain: error:") == 1, err
    # rank 1 sleeps in block 2's forward; rank 0 waits for it in the pipeline's receive
    assert "rank 1 did not arrive: it runs forward (slow_block_workload.py:" in err, err
    assert "rank 0 waits in torch.distributed" in err, err
    assert "stopped responding" not in err, err  # both ranks are alive: neither is taken for a stopped one
    assert str(run / "hang") in err, err
    stacks = {path.name: path.read_text() for path in (run / "hang").glob("rank-*.txt")}
    assert sorted(stacks) == ["rank-0.txt", "rank-1.txt"], stacks
    assert 'slow_block_workload.py", line' in stacks["rank-1.txt"] and "in forward" in stacks["rank-1.txt"]
    assert "slow_block_workload.py" not in stacks["rank-0.txt"]  # rank 0 is not in the block
    assert "torch/distributed" in stacks["rank-0.txt"], stacks["rank-0.txt"]


@pytest.mark.timeout(120)
def test_a_job_without_a_hang_leaves_no_hang_files_and_names_the_slow_replica(tmp_path, capfd):
    # a factor well above the default: on a loaded 2-core machine a fast rank's few ms may double, never triple
    # in two of the three steps measured
    run = tmp_path / "run"
    code = main(["train", "--workload", f"{FILE}:straggler", *ARGS, "--pp", "2", "--dp", "2", "--batch-size", "16",
                 "--log-every", "5", "--max-steps", "5", "--straggler-factor", "3", "--run-dir", str(run)])
    captured = capfd.readouterr()
    assert code == 0, captured.err
    assert not (run / "hang").exists()
    logged = captured.out + captured.err
    named = [line for line in logged.splitlines() if "straggler at step" in line]
    assert len(named) == 1, logged
    assert "straggler at step 5: rank 3 on " in named[0] and "stage 1, replica 1" in named[0], logged
    (record,) = [r for r in read_records(run / "steps.jsonl", "step") if "stragglers" in r]
    assert record["step"] == 5 and [s["rank"] for s in record["stragglers"]] == [3]
    assert record["stragglers"][0]["ratio"] > 3  # 0.2 s of sleep per step against a few ms of compute


@pytest.mark.timeout(240)
def test_a_save_slower_than_the_step_timeout_commits(tmp_path, capfd):
    """Rank 1 takes 10 s to hand its state to the save (by construction: the fixture sleeps there), the step timeout
    is 4 s: the save runs under --save-timeout and commits (fails on main: the watchdog ended the job mid-save)."""
    saves = tmp_path / "ckpt"
    code = main(["train", "--workload", f"{FILE}:slow_save", *ARGS, "--pp", "2", "--batch-size", "8",
                 "--max-steps", "2", "--save-every", "2", "--save-dir", str(saves), "--step-timeout", "4",
                 "--run-dir", str(tmp_path / "run")])
    err = capfd.readouterr().err
    assert code == 0, err
    assert "pipetrain: error:" not in err, err
    assert (saves / "step-00000002" / "pipetrain.json").is_file(), sorted(p.name for p in saves.iterdir())

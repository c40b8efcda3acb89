"""`pipetrain plan`: the table, ready command lines whose flags exist, and one clear message per bad input."""

from __future__ import annotations

import shlex

import pytest

from pipetrain.cli.main import build_parser, main



def _plan(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([*argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_prints_table_and_commands_that_parse(capsys, tmp_path):
    code, out, _ = _plan(capsys, "plan", "--gpus", "8", "--preset", "gpu", "--gpu-mem", "80", "--batch", "128",
                         "--top", "3", "--calibration", str(tmp_path / "none.json"))
    assert code == 2  # a missing explicit calibration file is an error
    code, out, err = _plan(capsys, "plan", "--nodes", "2", "--gpus-per-node", "4", "--preset", "gpu", "--gpu-mem", "80",
                           "--batch", "128", "--top", "3")
    assert code == 0, err
    assert "step s" in out and "samples/s" in out and "bubble" in out
    train = next(line for line in out.splitlines() if line.strip().startswith("pipetrain train"))
    sbatch = next(line for line in out.splitlines() if line.strip().startswith("pipetrain sbatch"))
    args = build_parser().parse_args(shlex.split(train)[1:])
    assert args.dp * args.pp * getattr(args, "tp", 1) == 8  # tp: once the engine has --tp, plan may choose it
    sb = build_parser().parse_args(shlex.split(sbatch)[1:])
    assert sb.nodes == 2 and sb.gpus_per_node == 4 and sb.dp * sb.pp * getattr(sb, "tp", 1) == 8
    build_parser().parse_args(["train", *sb.train_args[1:]])


@pytest.mark.parametrize("argv,needle", [
    (["--gpus", "17", "--preset", "gpu", "--batch", "256"], "no layout of 17 GPUs"),
    (["--gpus", "2", "--preset", "gpu", "--gpu-mem", "0.5", "--batch", "16"], "the leanest needs"),
    (["--gpus", "2", "--preset", "huge"], "unknown preset 'huge'"),
    (["--preset", "gpu"], "how many devices"),
    (["--gpus", "0"], "--gpus must be positive"),
])
def test_bad_input_one_clear_message(capsys, argv, needle):
    code, out, err = _plan(capsys, "plan", *argv)
    assert code == 2
    assert needle in err and err.count("pipetrain: error") == 1 and "Traceback" not in err


def test_malformed_profile(capsys, tmp_path):
    bad = tmp_path / "profile.json"
    bad.write_text('{"format": "pipetrain-profile/1", "blocks": "many"}')
    code, _, err = _plan(capsys, "plan", "--gpus", "2", "--profile", str(bad))
    assert code == 2 and str(bad) in err and err.count("pipetrain: error") == 1


@pytest.mark.parametrize("argv,needle", [
    (["--candidates", "0"], "--candidates must be >= 1"),
    (["--first-steps", "0"], "--first-steps must be >= 1"),
    (["--min-seconds", "-1"], "--min-seconds must be >= 0, got -1.0"),
])
def test_tune_bad_measuring_options(capsys, argv, needle):
    """Checked before anything is measured: one message, exit 2."""
    code, _, err = _plan(capsys, "tune", "--gpus", "2", "--preset", "cpu", "--batch", "32", *argv)
    assert code == 2 and needle in err and err.count("pipetrain: error") == 1 and "Traceback" not in err


def test_tune_rejects_a_profile(capsys, tmp_path):
    code, _, err = _plan(capsys, "tune", "--gpus", "2", "--profile", str(tmp_path / "p.json"))
    assert code == 2 and "--preset" in err and err.count("pipetrain: error") == 1


def test_plan_from_a_profile_names_its_workload(capsys, tmp_path):
    from pipetrain.partition.profile import BlockProfile, ModelProfile, save_profile

    blocks = tuple(BlockProfile(index=i, name=f"Block{i}", forward_s=0.01 * (i + 1), backward_s=0.02 * (i + 1),
                                param_bytes=4000, activation_bytes=16000, output_bytes=4096) for i in range(4))
    path = tmp_path / "profile.json"
    save_profile(ModelProfile(model="classifier:tiny", fingerprint="0" * 64, micro_batch_size=8, device="cpu",
                              dtype="float32", repeats=3, blocks=blocks), path)
    code, out, err = _plan(capsys, "plan", "--gpus", "2", "--profile", str(path), "--batch", "32", "--top", "2")
    assert code == 0, err
    assert "times rescaled linearly" in out
    train = next(line for line in out.splitlines() if line.strip().startswith("pipetrain train"))
    args = build_parser().parse_args(shlex.split(train)[1:])
    assert args.workload == "classifier" and args.preset == "tiny" and args.dp * args.pp == 2


def test_plan_does_not_import_torch(tmp_path):
    """`pipetrain plan` is pure planning: it starts without torch (which takes seconds to import)."""
    import subprocess
    import sys

    script = ("import sys; from pipetrain.cli.main import main; "
              "code = main(['plan', '--gpus', '64', '--preset', 'gpu', '--gpu-mem', '80', '--batch', '512', "
              f"'--top', '2', '--calibration', {str(tmp_path / 'absent.json')!r}]); "
              "sys.exit(3 if 'torch' in sys.modules else code)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 2 and "cannot read the calibration file" in done.stderr  # the error path, torch-free
    script = script.replace(f", '--calibration', {str(tmp_path / 'absent.json')!r}", "")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**__import__("os").environ, "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert "pipetrain train" in done.stdout

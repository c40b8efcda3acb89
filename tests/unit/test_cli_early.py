"""A bad `pipetrain train` command line is refused before torch is imported: the flags alone (values, ranges,
choices, flags that need another) are checked by `check_flags` (cli/train.py) on the torch-free parts of the job
description, with the message and exit code the full description gives. One fresh interpreter runs every case and
says, after each, whether torch is in `sys.modules`; its last case needs the workload (torch), so the probe is seen
to report an import too."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipetrain.cli import train as train_cli
from pipetrain.launch.env import START_METHOD_VARIABLE
from tests.unit.test_cli_errors import assert_one_error, clean_environ, cli  # noqa: F401  (the fixture)

#: case -> (the command line, the whole line it printed before the check moved, or texts that line names)
EARLY = {
    "pp-zero": (["train", "--pp", "0"], "pipetrain: error: pp must be a positive integer, got 0 (hint: pass pp >= 1)"),
    "negative-batch": (["train", "--batch-size", "-3"],
                       "pipetrain: error: batch_size must be positive, got -3 (hint: pass a batch_size of 1 or more)"),
    "unknown-schedule": (["train", "--schedule", "foo"],
                         "pipetrain: error: unknown schedule 'foo' (hint: choose one of: gpipe, 1f1b, "
                         "interleaved-1f1b, zero-bubble, zbv, dualpipev)"),
    "sequence-parallel-without-tp": (["train", "--sequence-parallel"], ["--sequence-parallel", "but tp=1"]),
    "dpo-flag-without-objective": (["train", "--dpo-beta", "0.2"], ["--dpo-beta", "--objective dpo is not given"]),
    "balance-with-layout-auto": (["train", "--layout", "auto", "--balance", "2,2"],
                                 ["--balance 2,2 fixes the split that --layout auto chooses"]),
    "keep-without-save-dir": (["train", "--keep", "2"], ["--keep needs --save-dir"]),
    "lr-nan": (["train", "--lr", "nan"], ["got nan"]),
}
#: a command line whose error needs the workload (its presets): said after torch is imported
LATE = ["train", "--preset", "nosuch", "--data", "synthetic"]


@pytest.fixture(scope="module")
def early_runs() -> list[tuple[int, str, bool]]:
    """(exit code, stderr, torch imported) of each EARLY case, then of LATE, in one fresh interpreter."""
    argvs = [argv for argv, _ in EARLY.values()] + [LATE]
    script = ("import contextlib, io, json, sys; from pipetrain.cli.main import main\n"
              "runs = []\n"
              f"for argv in {argvs!r}:\n"
              "    err = io.StringIO()\n"
              "    with contextlib.redirect_stderr(err):\n"
              "        code = main(argv)\n"
              "    runs.append((code, err.getvalue(), 'torch' in sys.modules))\n"
              "print(json.dumps(runs))\n")
    env = clean_environ() | {"OMP_NUM_THREADS": "1", START_METHOD_VARIABLE: "spawn"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr
    return [tuple(run) for run in json.loads(done.stdout)]


@pytest.mark.parametrize("case", list(EARLY))
def test_a_bad_flag_is_said_before_torch_is_imported(case, early_runs):
    code, err, torch_imported = early_runs[list(EARLY).index(case)]
    expected = EARLY[case][1]
    line = assert_one_error(code, "", err, *([expected] if isinstance(expected, str) else expected))
    if isinstance(expected, str):
        assert line == expected
    assert not torch_imported, f"{case}: torch was imported before {line!r}"


def test_the_probe_sees_torch_once_the_workload_is_needed(early_runs):
    """The check can fail: an error that needs the workload comes after torch's import, and the probe says so."""
    code, err, torch_imported = early_runs[-1]
    assert_one_error(code, "", err, "'nosuch'")
    assert torch_imported


@pytest.mark.parametrize("case", list(EARLY))
def test_the_full_description_says_the_same_line(case, cli, monkeypatch):
    """With the early check skipped, the job description (after torch) says the same line: each rule lives once."""
    monkeypatch.setattr(train_cli, "check_flags", lambda args: None)
    code, out, err, _ = cli(EARLY[case][0])
    expected = EARLY[case][1]
    line = assert_one_error(code, out, err, *([expected] if isinstance(expected, str) else expected))
    if isinstance(expected, str):
        assert line == expected

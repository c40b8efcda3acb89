"""`pipetrain train` that survives: exact resume, resume under another layout, stop signals, dead and hung ranks,
kill -9 during a save (and during a background write of --async-save), and the errors of bad checkpoint flags (real processes, real files, CPU/gloo).

Each job trains the tiny preset for 40 steps (batch 16 over 640 synthetic reviews, one epoch). A reference job
saves every 4 steps; other jobs start from copies of its checkpoints. Same layout: the epoch report (train loss
summed over every step, test loss) is equal bitwise. Another layout: within the parity tolerance.

A job's time is nearly all start-up (the launcher and every rank import torch; the 40 steps take about 2 s), so the
file runs as few jobs as its faults allow: the jobs that need no signal and no resource limit run in this process
(`_run`, main() itself: only the ranks start), one job serves several assertions (the resume after a killed
background write also checks that --async-save commits every checkpoint and changes no loss; the resume named by
the damaged-checkpoint message is the same-layout exactness check), and a job killed mid-save is not resumed again
where another test already resumes past a `.partial` folder.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipetrain.checkpoint import complete_checkpoints, latest_checkpoint
from pipetrain.cli.main import main
from pipetrain.launch.env import DEVICE_VARIABLE
from pipetrain.launch.forkserver import RANK_NAME_PREFIX

RTOL = 1e-5
ARGS = ["--preset", "tiny", "--data", "synthetic", "--train-samples", "640", "--test-samples", "32",
        "--batch-size", "16", "--epochs", "1", "--no-progress"]


def _command(*extra: str) -> list[str]:
    return [sys.executable, "-m", "pipetrain", "train", *ARGS, *extra]


def _train(*extra: str, preexec=None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(_command(*extra), capture_output=True, text=True, timeout=timeout, preexec_fn=preexec,
                          check=False)


def _run(*extra: str) -> int:
    """`pipetrain train ARGS EXTRA` in this process (its ranks are spawned: their output reaches capfd)."""
    return main(["train", *ARGS, *extra])


def _losses(path: Path) -> list[tuple[float, float]]:
    return [(r["train_loss"], r["test_loss"]) for r in json.loads(path.read_text())]


def _copy_checkpoint(source: Path, step: int, target: Path) -> Path:
    target.mkdir(parents=True)
    shutil.copytree(source / f"step-{step:08d}", target / f"step-{step:08d}")
    return target


def _kill_tree(pid: int) -> None:
    """SIGKILL `pid` and its descendants (one may end before its turn: a rank whose launcher died ends by itself)."""
    for each in _tree(pid):
        try:
            os.kill(each, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _tree(pid: int) -> list[int]:
    """`pid` and its living descendants (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if fields[0] != "Z":
                parents[int(entry.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        current = frontier.pop()
        if current in parents or current == pid:
            found.append(current)
        frontier += [child for child, parent in parents.items() if parent == current]
    return [p for p in found if p in parents]


def _ranks(job: subprocess.Popen) -> list[int]:
    """The rank processes of a self-spawned job (forked by the launcher's fork server, named pipetrain-rN)."""
    ranks = {}
    for pid in _tree(job.pid):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if name.startswith(RANK_NAME_PREFIX):
            ranks[int(name[len(RANK_NAME_PREFIX):])] = pid
    return [ranks[rank] for rank in sorted(ranks)]


#: Jobs started in the background by the running test (each in a session of its own: its process group).
_STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_job_left_behind():
    """A test that fails half-way must not leave its job running: it would slow every later test."""
    yield
    while _STARTED:
        job = _STARTED.pop()
        try:
            os.killpg(job.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        job.wait()


def _start_and_wait_for_checkpoint(save_dir: Path, *extra: str) -> subprocess.Popen:
    job = subprocess.Popen(_command("--save-dir", str(save_dir), *extra), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    _STARTED.append(job)
    deadline = time.monotonic() + 180  # a hang guard, generous: the 2 cores may be shared and loaded
    while not complete_checkpoints(save_dir):
        assert job.poll() is None, job.communicate()
        assert time.monotonic() < deadline, "no checkpoint within 180 s"
        time.sleep(0.05)
    return job


def _gone_within(job: subprocess.Popen, pids: list[int], bound_s: float) -> tuple[float, str]:
    """Seconds until the job and every process in `pids` ended (asserted below `bound_s`); the job's stderr."""
    start = time.monotonic()
    _, err = job.communicate(timeout=bound_s + 30)
    while any(Path(f"/proc/{p}").exists() and "Z" not in Path(f"/proc/{p}/stat").read_text().split(")")[1][:3]
              for p in pids):
        assert time.monotonic() - start < bound_s, f"processes left behind: {pids}"
        time.sleep(0.05)
    return time.monotonic() - start, err


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted job, saving every 4 steps into <folder>/ckpt; its epoch report in <folder>/metrics.json."""
    folder = tmp_path_factory.mktemp("reference")
    with pytest.MonkeyPatch.context() as patch:  # the module's fixture runs before conftest's per-test pin
        patch.setenv(DEVICE_VARIABLE, "cpu")
        code = _run("--save-dir", str(folder / "ckpt"), "--save-every", "4", "--keep", "all",
                    "--metrics", str(folder / "metrics.json"))
    assert code == 0
    return folder


def test_resume_as_dp2_fsdp_continues_the_losses(reference, tmp_path, capfd):
    # the pp=2 checkpoint under FSDP on 2 ranks (4-rank layouts: see test_checkpoint.py, one job for all of them);
    # from the newest of several complete checkpoints: --save-dir with --resume takes it
    save_dir = _copy_checkpoint(reference / "ckpt", 12, tmp_path / "ckpt")
    shutil.copytree(reference / "ckpt" / "step-00000008", save_dir / "step-00000008")
    code = _run("--save-dir", str(save_dir), "--resume", "--dp", "2", "--pp", "1", "--dp-mode", "fsdp",
                "--metrics", str(tmp_path / "metrics.json"))
    out, err = capfd.readouterr()
    assert code == 0, err
    assert "resumed from" in out and "step 12" in out, out
    for got, want in zip(_losses(tmp_path / "metrics.json"), _losses(reference / "metrics.json"), strict=True):
        assert got == pytest.approx(want, rel=RTOL)


def test_full_disk_says_so_once_and_keeps_the_previous_checkpoint(reference, tmp_path):
    save_dir = _copy_checkpoint(reference / "ckpt", 12, tmp_path / "ckpt")
    before = {p.name: p.read_bytes() for p in (save_dir / "step-00000012").iterdir()}

    def small_disk() -> None:  # no file may grow past 500 kB: the data fits (shared memory), a checkpoint shard not
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (500_000, 500_000))

    done = _train("--save-dir", str(save_dir), "--resume", "--save-every", "4", preexec=small_disk)
    assert done.returncode != 0
    assert done.stderr.count("pipetrain: error:") == 1, done.stderr
    assert "could not write checkpoint" in done.stderr and "File too large" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert [p.name for p in complete_checkpoints(save_dir)] == ["step-00000012"]
    assert {p.name: p.read_bytes() for p in (save_dir / "step-00000012").iterdir()} == before


def test_kill_during_a_save_leaves_the_previous_checkpoint(tmp_path):
    # a resume next to a `.partial` folder cleans it up: the resume after a killed background write asserts it
    save_dir = tmp_path / "ckpt"
    job = _start_and_wait_for_checkpoint(save_dir, "--save-every", "1")
    deadline = time.monotonic() + 60
    while not any(p.name.endswith(".partial") for p in save_dir.iterdir()):  # a save under way: kill everything
        assert time.monotonic() < deadline and job.poll() is None
    _kill_tree(job.pid)
    job.communicate()
    partial = [p for p in save_dir.iterdir() if p.name.endswith(".partial")]
    latest = latest_checkpoint(save_dir)
    assert partial and latest is not None
    assert latest.name < min(p.name for p in partial), (latest, partial)  # the one before the interrupted save


_STALLED_WRITE = """
import threading, time
import torch.distributed.checkpoint.filesystem as filesystem
_write = filesystem._FileSystemWriter.write_data
def _stalled(self, plan, planner):  # the background write of step 8 never ends (the test kills the job)
    if "step-00000008" in str(self.path) and threading.current_thread() is not threading.main_thread():
        time.sleep(3600)
    return _write(self, plan, planner)
filesystem._FileSystemWriter.write_data = _stalled
"""


def test_kill_during_a_background_write_keeps_the_previous_checkpoint_and_resume_is_exact(reference, tmp_path,
                                                                                         monkeypatch, capfd):
    """Also --async-save's own checks, on the resumed job (saving in the background from step 5 to 40, after the
    killed job's steps 1-8 under --async-save): every checkpoint committed, and no loss changed (the epoch report
    equals the reference's, saved synchronously, bitwise)."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(_STALLED_WRITE)  # loaded by every rank's interpreter
    original = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "site"), *([original] if original else [])]))
    save_dir = tmp_path / "ckpt"
    job = _start_and_wait_for_checkpoint(save_dir, "--save-every", "4", "--async-save")
    deadline = time.monotonic() + 60
    while not (save_dir / "step-00000008.partial").exists():  # the write of step 8 is under way, in the background
        assert time.monotonic() < deadline and job.poll() is None
        time.sleep(0.05)
    time.sleep(1.0)
    _kill_tree(job.pid)
    job.communicate()
    assert [p.name for p in complete_checkpoints(save_dir)] == ["step-00000004"]
    if original:
        monkeypatch.setenv("PYTHONPATH", original)
    else:
        monkeypatch.delenv("PYTHONPATH")
    capfd.readouterr()
    code = _run("--save-dir", str(save_dir), "--resume", "--async-save", "--save-every", "8", "--keep", "all",
                "--metrics", str(tmp_path / "metrics.json"))
    out, err = capfd.readouterr()
    assert code == 0, err
    assert "resumed from" in out and "step 4" in out, out
    assert _losses(tmp_path / "metrics.json") == _losses(reference / "metrics.json")
    assert not any(p.name.endswith(".partial") for p in save_dir.iterdir())
    assert [p.name for p in complete_checkpoints(save_dir)] == [f"step-{s:08d}" for s in (4, 8, 16, 24, 32, 40)]


def test_sigterm_stops_every_rank_at_one_step_and_saves(tmp_path):
    # exact resume after a stop signal: see tests/slurm/test_slurm_requeue.py (SIGUSR1, requeue, resume)
    save_dir = tmp_path / "ckpt"
    job = _start_and_wait_for_checkpoint(save_dir, "--save-every", "8")
    job.send_signal(signal.SIGTERM)  # to the launcher, which passes it on to its ranks
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    assert "stopped by SIGTERM after step" in out, out
    step = int(out.split("stopped by SIGTERM after step ")[1].split(";")[0])
    latest = latest_checkpoint(save_dir)
    assert latest.name == f"step-{step:08d}"  # one DCP save of that step, to which every rank wrote its shards
    assert sorted(p.name for p in latest.iterdir() if p.suffix == ".distcp") == ["__0_0.distcp", "__1_0.distcp"]


def test_a_killed_rank_ends_the_job_within_10_s_with_one_message(tmp_path):
    job = _start_and_wait_for_checkpoint(tmp_path / "ckpt", "--save-every", "2", "--epochs", "50")
    ranks = _ranks(job)
    assert len(ranks) == 2
    os.kill(ranks[1], signal.SIGKILL)
    seconds, err = _gone_within(job, [job.pid, *ranks], bound_s=10)
    assert job.returncode != 0
    assert err.count("pipetrain: error:") == 1 and "pipetrain-rank1" in err and "SIGKILL" in err, err
    assert "leaked semaphore" not in err, err
    print(f"SIGKILL of rank 1: every process gone {seconds:.1f} s later")


def test_a_stopped_rank_is_named_by_the_step_watchdog(tmp_path):
    job = _start_and_wait_for_checkpoint(tmp_path / "ckpt", "--save-every", "2", "--epochs", "50",
                                         "--step-timeout", "4")
    ranks = _ranks(job)
    os.kill(ranks[1], signal.SIGSTOP)
    seconds, err = _gone_within(job, [job.pid, *ranks], bound_s=30)
    assert job.returncode != 0
    assert err.count("pipetrain: error:") == 1 and "rank 1" in err and "stopped responding" in err, err
    assert latest_checkpoint(tmp_path / "ckpt") is not None
    print(f"SIGSTOP of rank 1 with --step-timeout 4: every process gone {seconds:.1f} s later")


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--resume"], "--resume needs --save-dir"),
        (["--resume", "--save-dir", "{empty}"], "no complete checkpoint"),
        (["--resume", "{empty}/step-00000004"], "no such checkpoint or folder"),
        (["--keep", "2"], "--keep needs --save-dir"),
        (["--async-save"], "--async-save needs --save-dir"),
        (["--save-dir", "/proc/pipetrain-checkpoints"], "cannot write checkpoints to --save-dir"),
        (["--metrics", "/proc/pipetrain-metrics.json"], "cannot write the metrics file"),
    ],
)
def test_bad_flags_fail_before_training_with_one_message(extra, expected, tmp_path, capsys):
    extra = [e.replace("{empty}", str(tmp_path)) for e in extra]
    assert main(["train", *ARGS, *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("pipetrain: error:") == 1 and expected in err, err


def test_a_damaged_newest_checkpoint_names_the_older_ones_and_resume_takes_one(reference, tmp_path, capfd):
    """...and the resume it names is exact: the same layout's epoch report equals the uninterrupted one bitwise."""
    save_dir = _copy_checkpoint(reference / "ckpt", 8, tmp_path / "ckpt")
    shutil.copytree(reference / "ckpt" / "step-00000012", save_dir / "step-00000012")
    (save_dir / "step-00000012" / "pipetrain.json").write_text("{ damaged")
    assert main(["train", *ARGS, "--save-dir", str(save_dir), "--resume"]) == 2
    err = capfd.readouterr().err
    assert err.count("pipetrain: error:") == 1 and "step-00000012" in err, err
    assert f"--resume {save_dir / 'step-00000008'}" in err, err

    # the older one, named as the message says; saving goes on beside it and keeps the default 3 newest
    code = _run("--resume", str(save_dir / "step-00000008"), "--save-every", "4", "--metrics",
                str(tmp_path / "metrics.json"))
    out, err = capfd.readouterr()
    assert code == 0, err
    assert "resumed from" in out and "step-00000008 (step 8" in out, out
    assert [p.name for p in complete_checkpoints(save_dir)] == ["step-00000032", "step-00000036", "step-00000040"]
    assert _losses(tmp_path / "metrics.json") == _losses(reference / "metrics.json")


def test_a_foreign_checkpoint_is_refused(reference, capsys):
    args = [a if a != "tiny" else "cpu" for a in ARGS]
    assert main(["train", *args, "--save-dir", str(reference / "ckpt"), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "written for model 'classifier:tiny', this job trains 'classifier:cpu'" in err, err


def test_export_loads_into_plain_sequential(reference, tmp_path, capsys):
    import torch

    from pipetrain import build_sequential
    from pipetrain.workloads.registry import get_workload

    assert main(["export", str(reference / "ckpt"), str(tmp_path / "model.pt")]) == 0
    model = build_sequential(get_workload("classifier").model("tiny"), seed=5)
    model.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    assert set(model.state_dict()) == set(torch.load(tmp_path / "model.pt", weights_only=True))


def test_a_checkpoint_saved_from_a_python_loop_is_refused_by_resume(tmp_path, capsys):
    from pipetrain.checkpoint import fingerprint
    from pipetrain.checkpoint.folders import CheckpointMeta, commit, final_folder, partial_folder, write_meta
    from pipetrain.workloads.registry import get_workload

    partial = partial_folder(tmp_path, 3)
    partial.mkdir()
    write_meta(partial, CheckpointMeta(step=3, model="classifier:tiny", layout={}, world_size=2, config={},
                                       fingerprint=fingerprint(get_workload("classifier").model("tiny")),
                                       extras={"epoch": 1}))
    commit(partial, final_folder(tmp_path, 3))
    assert main(["train", *ARGS, "--save-dir", str(tmp_path), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "was saved from a Python loop, not by `pipetrain train`" in err, err

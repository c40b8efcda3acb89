"""Batch script rendering: directives of the GPU and CPU variants, refusals, and the `pipetrain sbatch` verb."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import pytest

from pipetrain.cli import sbatch as cli
from pipetrain.errors import ConfigError
from pipetrain.launch.sbatch import SbatchRequest, render_sbatch

TRAIN = ["/opt/venv/bin/python", "-m", "pipetrain", "train", "--preset", "tiny"]


def directives(script: str) -> dict[str, str]:
    found = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH "):
            key, _, value = line.removeprefix("#SBATCH ").partition("=")
            found[key] = value
    return found


def srun_argv(script: str) -> list[str]:
    """The srun command line, without the `--resume` a requeued run adds (see test_requeue_...)."""
    (line,) = [line for line in script.splitlines() if line.startswith("srun ")]
    argv = shlex.split(line)
    assert argv[-1] == "${RESUME[@]}"
    return argv[:-1]


def test_gpu_one_task_per_gpu() -> None:
    req = SbatchRequest(
        command=TRAIN, job_name="imdb", nodes=2, gpus_per_node=4, tasks_per_node=4, cpus_per_task=10,
        time="02:00:00", dp=2, pp=4, schedule="1f1b", chunks=8, partition="gpu_p13", account="xyz@v100",
        setup="module load pytorch-gpu/py3/2.3.0",
    )
    script = render_sbatch(req)
    assert script.startswith("#!/bin/bash\n")
    assert directives(script) == {
        "--job-name": "imdb", "--nodes": "2", "--ntasks-per-node": "4", "--gres": "gpu:4",
        "--cpus-per-task": "10", "--hint": "nomultithread", "--time": "02:00:00", "--output": "%x-%j.out",
        "--error": "%x-%j.out", "--partition": "gpu_p13", "--account": "xyz@v100", "--signal": "USR1@120",
        "--requeue": "", "--open-mode": "append",
    }
    body = script.split("set -euo pipefail", 1)[1]
    assert "module load pytorch-gpu/py3/2.3.0" in body
    assert "export OMP_NUM_THREADS=$SLURM_CPUS_PER_TASK" in body
    # what pipetrain sets for the collectives' interface is said, and nothing is exported for it
    assert "# GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME: unset, each rank binds to the interface that routes" in body
    assert "export GLOO_SOCKET_IFNAME" not in body.replace("# export them here to choose another (e.g. export "
                                                            "GLOO_SOCKET_IFNAME=ib0).", "")
    assert "SOCKET_IFNAME" not in render_sbatch(SbatchRequest(command=TRAIN, tasks_per_node=2, pp=2, chunks=2))
    argv = srun_argv(script)
    assert argv[:2] == ["srun", "--kill-on-bad-exit=1"]
    assert argv[2:] == [*TRAIN, "--dp", "2", "--pp", "4", "--schedule", "1f1b", "--chunks", "8"]
    assert req.world_size == 8


def test_cpu_variant_has_no_gres_nor_optional_directives() -> None:
    script = render_sbatch(SbatchRequest(command=TRAIN, tasks_per_node=2, pp=2, chunks=2, error="job.err"))
    found = directives(script)
    assert "--gres" not in found and "--partition" not in found and "--account" not in found
    assert found["--ntasks-per-node"] == "2" and found["--error"] == "job.err"
    assert srun_argv(script)[-6:] == ["--dp", "1", "--pp", "2", "--chunks", "2"]


def test_one_task_per_node_passes_ranks_per_node() -> None:
    gpu = SbatchRequest(command=TRAIN, nodes=2, gpus_per_node=4, one_task_per_node=True, dp=2, pp=4)
    script = render_sbatch(gpu)
    assert directives(script)["--ntasks-per-node"] == "1" and directives(script)["--gres"] == "gpu:4"
    assert srun_argv(script)[-2:] == ["--ranks-per-node", "4"]
    cpu = SbatchRequest(command=TRAIN, nodes=3, one_task_per_node=True, ranks_per_node=2, cpus_per_task=4, pp=6)
    script = render_sbatch(cpu)
    assert "SLURM_CPUS_PER_TASK / 2" in script
    assert srun_argv(script)[-2:] == ["--ranks-per-node", "2"] and cpu.world_size == 6
    spawning = SbatchRequest(command=TRAIN, nodes=3, one_task_per_node=True, ranks_per_node=2, pp=6)
    assert directives(render_sbatch(spawning))["--cpus-per-task"] == "2"  # a core for each rank the task spawns
    assert directives(render_sbatch(SbatchRequest(command=TRAIN, tasks_per_node=2, pp=2)))["--cpus-per-task"] == "1"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tasks_per_node": 2, "dp": 1, "pp": 4}, "dp=1 x pp=4 = 4 ranks, but the job has 2"),
        ({"gpus_per_node": 2, "tasks_per_node": 4, "pp": 4}, "4 tasks per node but only 2 GPUs"),
        ({"one_task_per_node": True}, "--ranks-per-node"),
        ({"one_task_per_node": True, "tasks_per_node": 2, "ranks_per_node": 2}, "tasks_per_node=2"),
        ({"one_task_per_node": True, "gpus_per_node": 2, "ranks_per_node": 4, "pp": 4}, "only 2 GPUs"),
        ({"ranks_per_node": 2}, "only applies to one task per node"),
        ({"time": "90 minutes"}, "HH:MM:SS"),
        ({"time": "01:75:00"}, "HH:MM:SS"),
        ({"nodes": 0}, "nodes must be an integer >= 1"),
        ({"gpus_per_node": -1}, "gpus_per_node"),
        ({"tasks_per_node": True}, "tasks_per_node"),
        ({"job_name": "my job"}, "job_name"),
        ({"partition": "gpu;rm"}, "partition"),
        ({"command": []}, "command is empty"),
        ({"command": [*TRAIN, "--pp", "2"]}, "already sets --pp"),
        ({"command": [*TRAIN, "--chunks=4"], "chunks": 2}, "already sets --chunks=4"),
        ({"command": [*TRAIN, "--ranks-per-node", "2"], "one_task_per_node": True, "gpus_per_node": 1}, "already sets"),
        ({"tasks_per_node": 2, "pp": 2, "schedule": "1f1b", "chunks": 1}, "at least as many micro-batches"),
        ({"setup": "module purge\nmodule load x"}, "several lines"),
    ],
)
def test_refusals(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        SbatchRequest(**{"command": TRAIN, **fields})
    assert message in str(info.value)
    assert info.value.hint


def test_schedule_and_chunks_may_stay_in_the_command() -> None:
    req = SbatchRequest(command=[*TRAIN, "--chunks", "2"], tasks_per_node=2, pp=2)
    assert srun_argv(render_sbatch(req))[-6:] == ["--chunks", "2", "--dp", "1", "--pp", "2"]


def test_request_is_frozen_and_keyword_only() -> None:
    req = SbatchRequest(command=TRAIN)
    assert isinstance(req.command, tuple) and req.time == "01:00:00"
    with pytest.raises(AttributeError):
        req.nodes = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        SbatchRequest(TRAIN)  # type: ignore[misc]
    assert SbatchRequest(command=TRAIN, time="1-12:00:00").time == "1-12:00:00"


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pipetrain")
    cli.add_parser(parser.add_subparsers(dest="verb")).set_defaults(run=cli.run)
    return parser.parse_args(argv)


def test_cli_prints_script_with_this_interpreter(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse(["sbatch", "--pp", "2", "--chunks", "2", "--", "--preset", "tiny", "--max-steps", "5"])
    assert cli.run(args) == 0
    script = capsys.readouterr().out
    assert directives(script)["--ntasks-per-node"] == "2"
    argv = srun_argv(script)
    assert argv[2:6] == [str(Path(sys.executable).absolute()), "-m", "pipetrain", "train"]
    assert argv[6:] == ["--preset", "tiny", "--max-steps", "5", "--dp", "1", "--pp", "2", "--chunks", "2"]


def test_cli_writes_file(tmp_path: Path) -> None:
    target = tmp_path / "jobs" / "train.sh"
    args = parse(
        ["sbatch", "--nodes", "2", "--gpus-per-node", "4", "--dp", "2", "--pp", "4", "--time", "00:20:00",
         "--partition", "gpu_p2", "--account", "abc@a100", "--job-name", "sweep", "--log", "logs/%j.out",
         "--output", str(target)]
    )
    assert cli.run(args) == 0
    found = directives(target.read_text())
    assert (found["--ntasks-per-node"], found["--gres"], found["--job-name"]) == ("4", "gpu:4", "sweep")
    assert found["--output"] == "logs/%j.out" and found["--time"] == "00:20:00"
    assert target.stat().st_mode & 0o100


def test_cli_refusals() -> None:
    with pytest.raises(ConfigError, match="after `--`"):
        cli.run(parse(["sbatch", "stray"]))
    with pytest.raises(ConfigError, match="already sets --dp"):
        cli.run(parse(["sbatch", "--", "--dp", "2"]))
    with pytest.raises(ConfigError, match="but the job has 3"):
        cli.run(parse(["sbatch", "--pp", "2", "--ntasks-per-node", "3"]))


def test_cpu_request_defaults_to_a_share_per_gpu_and_says_so() -> None:
    per_gpu = SbatchRequest(command=TRAIN, gpus_per_node=4, tasks_per_node=4, pp=4)
    assert directives(render_sbatch(per_gpu))["--cpus-per-task"] == "10"
    node = SbatchRequest(command=TRAIN, gpus_per_node=4, one_task_per_node=True, pp=4)
    script = render_sbatch(node)
    assert directives(script)["--cpus-per-task"] == "40"
    assert "# CPUs: 40 per task = 10 per GPU x 4 GPU(s) per task" in script and "--cpus-per-gpu" in script
    assert directives(render_sbatch(SbatchRequest(command=TRAIN, gpus_per_node=4, one_task_per_node=True, pp=4,
                                                  cpus_per_gpu=6)))["--cpus-per-task"] == "24"
    assert directives(render_sbatch(SbatchRequest(command=TRAIN, pp=1)))["--cpus-per-task"] == "1"


def test_requeue_on_the_warning_signal_resumes_the_requeued_run() -> None:
    script = render_sbatch(SbatchRequest(command=TRAIN, pp=1, warn_seconds=300))
    assert directives(script)["--signal"] == "USR1@300" and "--requeue" in directives(script)
    assert directives(script)["--open-mode"] == "append"  # the requeued run's log follows the first run's
    assert 'if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then RESUME=(--resume); fi' in script


def test_mpirun_launcher_exports_the_rendezvous_and_forwards_the_warning_signal() -> None:
    script = render_sbatch(SbatchRequest(command=TRAIN, nodes=2, tasks_per_node=2, dp=2, pp=2, launcher="mpirun"))
    assert directives(script)["--signal"] == "B:USR1@120"  # to the batch shell, which hands it to mpirun
    assert not [line for line in script.splitlines() if line.startswith("srun ")]
    (line,) = [line for line in script.splitlines() if line.startswith("mpirun ")]
    assert line.startswith("mpirun -np $(( SLURM_JOB_NUM_NODES * 2 )) --map-by ppr:2:node --bind-to none -x ")
    argv = shlex.split(line)
    for name in ("MASTER_ADDR", "MASTER_PORT", "PIPETRAIN_DEVICE", "OMP_NUM_THREADS"):
        assert argv[argv.index(name) - 1] == "-x"
    assert argv[argv.index(TRAIN[0]):] == [*TRAIN, "--dp", "2", "--pp", "2", "${RESUME[@]}", "&"]
    assert 'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"' in script
    assert "trap 'kill -USR1 \"$MPIRUN_PID\" 2>/dev/null || true' USR1" in script
    with pytest.raises(ConfigError, match="launcher 'horovodrun'"):
        SbatchRequest(command=TRAIN, launcher="horovodrun")


def test_cli_launcher_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.run(parse(["sbatch", "--pp", "2", "--launcher", "mpirun", "--", "--preset", "tiny"])) == 0
    assert "\nmpirun -np $(( SLURM_JOB_NUM_NODES * 2 )) " in capsys.readouterr().out


RANGE = [*TRAIN, "--save-dir", "ckpt", "--profile", "p.json", "--calibration", "c.json"]


def test_node_range_renders_one_task_per_node_laid_out_at_each_start_and_resumed_after_a_requeue() -> None:
    req = SbatchRequest(command=RANGE, nodes=2, min_nodes=1, one_task_per_node=True, ranks_per_node=2,
                        cpus_per_task=2, dp=None, pp=2)
    script = render_sbatch(req)
    found = directives(script)
    assert found["--nodes"] == "1-2" and "--requeue" in found
    assert "--ntasks-per-node" not in found  # a requeued job would keep the first allocation's task count
    argv = srun_argv(script)
    assert argv[:4] == ["srun", "--kill-on-bad-exit=1", "--nodes=$SLURM_JOB_NUM_NODES", "--ntasks-per-node=1"]
    assert argv[4:] == [*RANGE, "--layout", "auto", "--pp", "2", "--ranks-per-node", "2"]
    assert 'then RESUME=(--resume auto --on-resize auto); fi' in script
    assert "2-4 ranks on 1-2 node(s)" in script
    fixed = SbatchRequest(command=TRAIN, nodes=2, min_nodes=2, tasks_per_node=1, dp=None, pp=2)  # 2-2: a count
    assert fixed.min_nodes is None and fixed.dp == 1 and directives(render_sbatch(fixed))["--nodes"] == "2"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"min_nodes": 3}, "the minimum is above the maximum"),
        ({"one_task_per_node": False, "tasks_per_node": 2, "ranks_per_node": None}, "needs one task per node"),
        ({"dp": 2, "pp": 2}, "these fix the job at 4 ranks, but it may run on 2"),
        ({"pp": 4}, "--pp 4 does not divide the 2 ranks of 1 node(s)"),
        ({"tp": 2}, "lays out dp x pp only"),
        ({"command": TRAIN}, "no --save-dir"),
        ({"command": [*TRAIN, "--save-dir", "c"]}, "no --profile"),
        ({"command": [*RANGE, "--on-resize", "stop"]}, "already sets --on-resize"),
        ({"command": [*RANGE, "--layout", "auto"]}, "already sets --layout"),
    ],
)
def test_node_range_refusals(fields: dict[str, object], message: str) -> None:
    base = {"command": RANGE, "nodes": 2, "min_nodes": 1, "one_task_per_node": True, "ranks_per_node": 2, "dp": None,
            "pp": 2}
    with pytest.raises(ConfigError) as info:
        SbatchRequest(**{**base, **fields})
    assert message in str(info.value) and info.value.hint


def test_cli_node_range(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sbatch", "--nodes", "1-2", "--ntasks-per-node", "2", "--pp", "2", "--", "--preset", "tiny", "--save-dir",
            "c", "--profile", "p.json"]
    assert cli.run(parse(argv)) == 0
    script = capsys.readouterr().out
    assert directives(script)["--nodes"] == "1-2" and "--ntasks-per-node" not in directives(script)
    assert srun_argv(script)[-6:] == ["--layout", "auto", "--pp", "2", "--ranks-per-node", "2"]
    with pytest.raises(ConfigError, match="neither a node count nor a range"):
        cli.run(parse(["sbatch", "--nodes", "1-x"]))
    with pytest.raises(ConfigError, match="1 <= MIN <= MAX"):
        cli.run(parse(["sbatch", "--nodes", "2-1"]))
    with pytest.raises(ConfigError, match="--nodes 1-2 on CPU nodes needs the ranks per node"):
        cli.run(parse(["sbatch", "--nodes", "1-2", "--", "--save-dir", "c", "--profile", "p.json"]))

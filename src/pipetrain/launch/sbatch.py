"""Slurm batch scripts: the ready-to-submit script a validated `SbatchRequest` renders (Jean Zay conventions)."""

from __future__ import annotations

import shlex

from pipetrain.launch.env import DEVICE_VARIABLE
from pipetrain.launch.node_range import range_comment
from pipetrain.launch.sbatch_request import DEFAULT_CPUS_PER_GPU, DEFAULT_WARN_SECONDS, LAUNCHERS, SbatchRequest

__all__ = ["SbatchRequest", "render_sbatch", "DEFAULT_CPUS_PER_GPU", "DEFAULT_WARN_SECONDS", "LAUNCHERS"]


def render_sbatch(req: SbatchRequest) -> str:
    """A complete batch script for `req`, ready for ``sbatch``."""
    ranged = req.min_nodes is not None
    directives = [f"--job-name={req.job_name}", f"--nodes={f'{req.min_nodes}-' if ranged else ''}{req.nodes}"]
    if not ranged:  # a node range: one task per node, Slurm's default (a requeue keeps an explicit task count)
        directives.append(f"--ntasks-per-node={req.tasks_per_node}")
    if req.gpus_per_node:
        directives.append(f"--gres=gpu:{req.gpus_per_node}")
    directives += [
        f"--cpus-per-task={req.cpus}",
        "--hint=nomultithread",
        f"--time={req.time}",
        f"--signal={'B:' if req.launcher == 'mpirun' else ''}USR1@{req.warn_seconds}",
        "--requeue",
        "--open-mode=append",
        f"--output={req.output}",
        f"--error={req.error or req.output}",
    ]
    if req.partition:
        directives.append(f"--partition={req.partition}")
    if req.account:
        directives.append(f"--account={req.account}")

    device = f"{req.gpus_per_node} GPU(s)" if req.gpus_per_node else "CPU only"
    layout = (
        f"one task per node spawning {req.local_world_size} ranks"
        if req.one_task_per_node
        else f"one task per rank, {req.tasks_per_node} per node"
    )
    resume = "--resume auto --on-resize auto" if ranged else "--resume"
    lines = ["#!/bin/bash", *(f"#SBATCH {d}" for d in directives), ""]
    if ranged:
        lines += [
            f"# Rendered by `pipetrain sbatch`: {req.min_nodes * req.local_world_size}-{req.world_size} ranks on "
            f"{req.min_nodes}-{req.nodes} node(s), {layout}, {device}; the ranks choose",
            "# their layout at each start (--layout auto; the layout flags given are its constraints).",
        ]
    else:
        lines.append(f"# Rendered by `pipetrain sbatch`: dp={req.dp} x pp={req.pp}{f' x tp={req.tp}' if req.tp > 1 else ''} = "
                     f"{req.world_size} ranks on {req.nodes} node(s), {layout}, {device}.")
    lines += [
        req.cpus_comment(),
        f"# {req.warn_seconds} s before the time limit Slurm sends SIGUSR1: with --save-dir, every rank stops at the same",
        f"# step, saves, and the job requeues itself; a requeued run (SLURM_RESTART_COUNT > 0) adds {resume}.",
        *range_comment(req),
        "# Submit with: sbatch <this file>",
        "set -euo pipefail",
        "",
    ]
    if req.setup and req.setup.strip():
        lines += [req.setup.strip(), ""]
    if req.one_task_per_node and req.local_world_size > 1:
        n = req.local_world_size
        lines += [
            f"# The task's CPUs are shared by its {n} ranks.",
            f"export OMP_NUM_THREADS=$(( SLURM_CPUS_PER_TASK >= {n} ? SLURM_CPUS_PER_TASK / {n} : 1 ))",
        ]
    else:
        lines.append("export OMP_NUM_THREADS=$SLURM_CPUS_PER_TASK")
    lines += [
        f"export {DEVICE_VARIABLE}={req.device}  # every rank on {req.device}; a --device of the command must agree",
        *_interface_comment(req),
        "RESUME=()",
        f'if [ "${{SLURM_RESTART_COUNT:-0}}" -gt 0 ]; then RESUME=({resume}); fi',
        "",
        *_launch_lines(req),
        "",
    ]
    return "\n".join(lines)


def _launch_lines(req: SbatchRequest) -> list[str]:
    """The line that starts the tasks: srun, or Open MPI's mpirun with the rendezvous exported to every rank."""
    command = shlex.join(req.train_argv()) + ' "${RESUME[@]}"'
    if req.launcher == "srun":
        nodes = '--nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 ' if req.min_nodes is not None else ""
        return ["srun --kill-on-bad-exit=1 " + nodes + command]
    exported = " ".join(f"-x {name}" for name in ("OMP_NUM_THREADS", DEVICE_VARIABLE, "MASTER_ADDR", "MASTER_PORT"))
    return [
        "# mpirun (Open MPI) reads the nodes of the allocation; rank 0 runs on the first node, where every rank",
        "# meets it (MASTER_ADDR), on a port derived from the job id. A rank that fails ends the whole job.",
        'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        "export MASTER_PORT=$(( 20000 + SLURM_JOB_ID % 20000 ))",
        f"mpirun -np $(( SLURM_JOB_NUM_NODES * {req.tasks_per_node} )) --map-by ppr:{req.tasks_per_node}:node "
        f"--bind-to none {exported} " + command + " &",
        "# Slurm's warning signal reaches this shell (B:), which hands it to mpirun; mpirun passes SIGUSR1 on to",
        "# every rank. `wait` returns early when the trap runs: wait again until mpirun has ended.",
        "MPIRUN_PID=$!",
        'trap \'kill -USR1 "$MPIRUN_PID" 2>/dev/null || true\' USR1',
        'status=0; wait "$MPIRUN_PID" || status=$?',
        'while kill -0 "$MPIRUN_PID" 2>/dev/null; do status=0; wait "$MPIRUN_PID" || status=$?; done',
        'exit "$status"',
    ]


def _interface_comment(req: SbatchRequest) -> list[str]:
    """What a multi-node script says about the socket interface (pipetrain chooses it; nothing is exported)."""
    if req.nodes < 2:
        return []
    names = "GLOO_SOCKET_IFNAME" + (" and NCCL_SOCKET_IFNAME" if req.device == "cuda" else "")
    return [
        f"# {names}: unset, each rank binds to the interface that routes to the first node (MASTER_ADDR);",
        "# export them here to choose another (e.g. export GLOO_SOCKET_IFNAME=ib0).",
    ]

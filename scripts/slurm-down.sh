#!/usr/bin/env bash
# Stop the single-node Slurm cluster started by scripts/slurm-up.sh (slurmd, slurmctld, munged).
#
# Cancels the jobs still queued, then stops each daemon by the process id in its pid file.
# Configuration, munge key and state directories are kept, so slurm-up.sh restarts quickly.
# Prints one status line.
set -uo pipefail

WAIT_SECONDS="${SLURM_DOWN_WAIT:-15}"
stopped=()

# stop NAME PIDFILE: signal the pid in PIDFILE if it is a live NAME process, wait, then force.
stop() {
    local name=$1 pid
    pid="$(cat "$2" 2>/dev/null || true)"
    [[ $pid =~ ^[0-9]+$ ]] && [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$name" ]] || return 0
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 $((WAIT_SECONDS * 4))); do
        kill -0 "$pid" 2>/dev/null || { stopped+=("$name"); return 0; }
        sleep 0.25
    done
    kill -9 "$pid" 2>/dev/null || true
    stopped+=("$name (killed after ${WAIT_SECONDS} s)")
}

if command -v scancel >/dev/null 2>&1 && command -v squeue >/dev/null 2>&1; then
    timeout 10 squeue --noheader --format=%i 2>/dev/null | xargs -r timeout 10 scancel 2>/dev/null || true
fi
stop slurmd /run/slurmd.pid
stop slurmctld /run/slurmctld.pid
stop munged /run/munge/munged.pid
if ((${#stopped[@]})); then
    echo "slurm-down: stopped ${stopped[*]}"
else
    echo "slurm-down: nothing was running"
fi

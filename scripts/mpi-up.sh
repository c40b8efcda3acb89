#!/usr/bin/env bash
# What the mpirun tests (tests/distributed/test_mpi.py) need: Open MPI's `mpirun` (Debian's openmpi-bin). Installs it
# when missing, as root with apt-get; else says what to install and goes on: the mpirun tests skip without it.
# Idempotent: does nothing when `mpirun` is already there. Reads no stdin.
set -euo pipefail
APT_TIMEOUT=${APT_TIMEOUT:-600}
command -v mpirun >/dev/null 2>&1 && exit 0
if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "mpi-up: installing openmpi-bin (for the mpirun tests)" >&2
    export DEBIAN_FRONTEND=noninteractive
    # a failed install (no network, no mirror) must not stop the set-up: only the mpirun tests need it
    if ! { timeout "$APT_TIMEOUT" apt-get update -qq </dev/null >&2 &&
           timeout "$APT_TIMEOUT" apt-get install -y -qq --no-install-recommends openmpi-bin </dev/null >&2; }; then
        echo "mpi-up: could not install openmpi-bin; the mpirun tests will skip" >&2
    fi
else
    echo "mpi-up: the mpirun tests need Open MPI (Debian: sudo apt-get install openmpi-bin); they skip without it" >&2
fi

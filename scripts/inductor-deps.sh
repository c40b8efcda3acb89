#!/usr/bin/env bash
# What `--compile` (torch.compile, inductor) needs on CPU: a C++ compiler (g++, inductor's default) and the Python
# headers (Python.h) of the interpreter the virtual environment is made from. Installs the missing Debian packages
# (g++, python3-dev) when run as root with apt-get; else says what to install and goes on: everything but
# `--compile` works without them, and its tests skip with the reason.
# Usage: scripts/inductor-deps.sh [PYTHON]   (default: python3)
set -euo pipefail
PYTHON=${1:-python3}
APT_TIMEOUT=${APT_TIMEOUT:-600}
missing=()
command -v g++ >/dev/null 2>&1 || missing+=(g++)
headers=$("$PYTHON" -c 'import os, sysconfig; print(os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))')
[[ $headers == True ]] || missing+=(python3-dev)
((${#missing[@]})) || exit 0
if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "inductor-deps: installing ${missing[*]} (for --compile)" >&2
    export DEBIAN_FRONTEND=noninteractive
    # a failed install (no network, no mirror) must not stop the set-up: only --compile needs these
    if ! { timeout "$APT_TIMEOUT" apt-get update -qq </dev/null >&2 &&
           timeout "$APT_TIMEOUT" apt-get install -y -qq --no-install-recommends "${missing[@]}" </dev/null >&2; }; then
        echo "inductor-deps: could not install ${missing[*]}; --compile will not work, the rest does" >&2
    fi
else
    echo "inductor-deps: --compile needs ${missing[*]} (Debian: sudo apt-get install ${missing[*]}); the rest works without" >&2
fi

"""CPU seconds of a command's whole process tree: `python scripts/tree-cpu.py CMD ARGS...`.

This process is the tree's child subreaper (Linux `PR_SET_CHILD_SUBREAPER`), so orphans (a fork server, its ranks, an
agent's workers) are reparented to it and reaped here, and their CPU time counts. Prints to stderr, at the end:
`CPU <user + system> s wall <s> rc <command's exit code> load <1-min load average>`; exits with the command's code.
Processes started outside the tree (Slurm's, under slurmd) do not count."""

from __future__ import annotations

import ctypes
import os
import resource
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python scripts/tree-cpu.py CMD [ARGS...]", file=sys.stderr)
        return 2
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.execvp(argv[0], argv)
    code = 1
    while True:
        try:
            done, status = os.wait()
        except ChildProcessError:
            break
        if done == pid:
            code = os.waitstatus_to_exitcode(status)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"CPU {usage.ru_utime + usage.ru_stime:.1f} s wall {time.monotonic() - start:.1f} s rc {code} "
          f"load {os.getloadavg()[0]:.1f}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""What the communication backends say when a job fails, turned into one line with a hint: gloo's lost connections,
NCCL's collective timeouts, aborted communicators and duplicate GPUs, and the signals that end a rank silently
(SIGKILL: the out-of-memory killer; SIGABRT: NCCL's watchdog after a collective timed out, or a C++ error)."""

from __future__ import annotations

from pipetrain.errors import RankFailedError

__all__ = ["backend_failure", "error_text", "signal_hint"]

#: (texts any of which identifies the failure, message with {rank}, hint)
_KNOWN: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (("Connection closed by peer", "Connection reset by peer"),
     "rank {rank} lost its connection to another rank, which probably died",
     "the launcher (or Slurm) names the rank that failed first"),
    (("Duplicate GPU detected",),
     "rank {rank}: two ranks of this node drive one GPU, which NCCL refuses ('Duplicate GPU detected')",
     "one rank per GPU: fewer ranks per node (--pp/--dp), one GPU bound per task, or --device cpu"),
    (("Watchdog caught collective operation timeout", "collective operation timeout"),
     "rank {rank}: an NCCL collective did not complete within the process-group timeout",
     "another rank is stuck or died first; the process-group timeout is 2 x --step-timeout (at least 600 s): "
     "raise --step-timeout for steps that are legitimately slower"),
    (("NCCL communicator was aborted", "communicator was aborted", "ncclRemoteError", "ncclSystemError"),
     "rank {rank}: its NCCL communicator was aborted (another rank failed, or a collective timed out)",
     "the launcher (or Slurm) names the rank that failed first"),
)


def error_text(err: BaseException) -> str:
    """The messages of `err` and of the errors that caused it (torch's pipelining re-raises a backend error as
    "Failed to run stage backward" with the original only as its cause)."""
    texts, seen = [], set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        texts.append(str(current))
        current = current.__cause__ or current.__context__
    return "\n".join(texts)


def backend_failure(err: BaseException, rank: int) -> RankFailedError | None:
    """`err` as one `RankFailedError` line when it (or its cause) is a backend failure listed above, else None (a
    real bug: keep its traceback)."""
    text = error_text(err)
    for needles, message, hint in _KNOWN:
        if any(needle in text for needle in needles):
            return RankFailedError(message.format(rank=rank), hint=hint)
    return None


def signal_hint(name: str | None) -> str:
    """The hint for a rank that ended without a report, killed by the signal `name` (e.g. "SIGKILL"; None: an exit
    code that is no signal)."""
    if name == "SIGABRT":
        return ("it aborted: NCCL's watchdog aborts a rank whose collective timed out (the process-group timeout "
                "is 2 x --step-timeout, at least 600 s), or a C++ error ended it; its stderr says which")
    if name in (None, "SIGKILL"):
        return "it was probably killed (out of memory?); see the system log"
    return f"it was ended by {name} or crashed; see its output and the system log"

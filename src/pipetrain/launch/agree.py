"""Before building stages: do all ranks run the same layout? Nodes started with different --dp/--pp/--schedule/...
flags that fit the same world size would otherwise build mismatched stages and hang or fail obscurely."""

from __future__ import annotations

import threading

import torch.distributed as dist

from pipetrain.config import ParallelConfig
from pipetrain.errors import ConfigError
from pipetrain.launch.spawn import fail_now

__all__ = ["agree_on_layout", "describe_layout", "layout_disagreement"]

#: Seconds at most a rank other than rank 0 waits for rank 0 to have said it before ending quietly.
_QUIET_S = 20.0


def describe_layout(parallel: ParallelConfig) -> str:
    """The layout in the words of the flags: dp, dp mode, pp, schedule, chunks, stages per rank, balance."""
    p = parallel.pipeline
    text = f"dp={parallel.dp} ({parallel.dp_text}) x pp={p.pp}, schedule {p.schedule}, chunks {p.n_microbatches}"
    if p.stages_per_rank is not None:
        text += f", {p.stages_per_rank} stages per rank"
    return text + (f", balance {list(p.balance)}" if p.balance else f", partition {p.partition}")


def layout_disagreement(layouts: list[tuple[str, str]]) -> str | None:
    """The message for ranks whose layouts differ, or None when all agree. `layouts[r]` is rank r's
    (full description, short description); ranks are grouped by layout, rank 0's first."""
    groups: dict[str, list[int]] = {}
    for rank, (full, _) in enumerate(layouts):
        groups.setdefault(full, []).append(rank)
    if len(groups) == 1:
        return None
    shorts = {full: layouts[ranks[0]][1] for full, ranks in groups.items()}
    ambiguous = len(set(shorts.values())) < len(shorts)  # differ beyond the flags' words: show everything
    parts = [f"{'rank' if len(ranks) == 1 else 'ranks'} {_ranges(ranks)}: {full if ambiguous else shorts[full]}"
             for full, ranks in groups.items()]
    return "the ranks of this job were started with different layouts: " + "; ".join(parts)


def agree_on_layout(parallel: ParallelConfig) -> None:
    """Compare this rank's layout with every other's (one all-gather); rank 0 raises `ConfigError` naming the
    differing ranks, the others end quietly. Needs the job's process group."""
    mine = (repr(parallel), describe_layout(parallel))
    layouts: list[tuple[str, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(layouts, mine)
    problem = layout_disagreement([layout for layout in layouts if layout is not None])
    if problem is None:
        return
    if dist.get_rank() == 0:
        raise ConfigError(problem, hint="start every node with the same --dp, --pp, --schedule, --chunks and --balance "
                                        "(the same command line or --config file)")
    _wait_for_rank_0_to_end(_QUIET_S)
    fail_now("", code=2)


def _wait_for_rank_0_to_end(timeout_s: float) -> None:
    """Until rank 0 has ended (its connections close: a barrier it never joins fails) or `timeout_s` passed.
    Ending first could get rank 0 killed by a launcher (torchrun) before it prints; ranks started by hand
    (no launcher to end them) need not wait the whole time."""
    ended = threading.Event()

    def barrier() -> None:
        try:
            dist.barrier()
        except Exception:  # rank 0 is gone
            pass
        ended.set()

    threading.Thread(target=barrier, name="pipetrain-wait-rank0", daemon=True).start()
    ended.wait(timeout_s)


def _ranges(ranks: list[int]) -> str:
    """Sorted ranks as spans: [0, 1, 2, 5] -> "0-2, 5"."""
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)

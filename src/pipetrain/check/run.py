"""One check: the same steps of a layout and of the single-process reference, compared into a `CheckReport`."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from contextlib import contextmanager
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from pipetrain.blocks import build_sequential
from pipetrain.check.compare import spread, step_diffs
from pipetrain.check.layout import layout_runs
from pipetrain.check.reference import probe_hazards, quiet, reference_run, static_hazards
from pipetrain.check.findings import TOLERANCES, CheckReport, Hazard
from pipetrain.errors import ConfigError, RankFailedError
from pipetrain.pipeline.runs import plan_runs

__all__ = ["check_batches", "run_check", "run_checks", "DEFAULT_STEPS", "DEFAULT_LR"]

DEFAULT_STEPS = 3
#: plain SGD on both sides: a parameter difference is then a gradient difference carried forward (AdamW's first
#: steps are ~lr * sign(gradient), which turns round-off of a near-zero gradient into a full step)
DEFAULT_LR = 0.05


def check_batches(config, train, steps: int) -> list:
    """The first `steps` global batches of `train`, in order (no shuffling), each divisible among the replicas."""
    workload = config.task()
    stream = workload.batches(train, config.batch_size, shuffle=False, seed=config.seed, epoch=0, replica=0,
                              replicas=1, bucket=bool(config.bucket))
    batches = list(itertools.islice(stream, steps))
    if len(batches) < steps:
        raise ConfigError(f"the data gives {len(batches)} batch(es) of {config.batch_size}, fewer than --steps {steps}",
                          hint="pass fewer --steps, a smaller --batch-size, or more data")
    dp = config.parallel.dp
    for number, (_, y) in enumerate(batches, 1):
        if y.shape[0] % dp:
            raise ConfigError(f"batch {number} holds {y.shape[0]} samples, which dp={dp} replicas cannot share "
                              "equally", hint=f"pass a --batch-size that is a multiple of {dp}")
    return batches


def _header(config, steps: int, lr: float, balance) -> list[str]:
    par, pipe = config.parallel, config.parallel.pipeline
    return [f"pipetrain check: workload {config.workload}, preset {config.preset}",
            f"layout: dp={par.dp} ({par.dp_text}) x pp={par.mesh_text} | schedule {pipe.schedule}, chunks "
            f"{pipe.n_microbatches}, {pipe.virtual_stages} stage(s) per rank, recompute {pipe.recompute_text} | balance "
            f"{','.join(map(str, balance))} | {config.precision}",
            f"reference: the unsplit model in one process | {steps} step(s) of the same global batches of "
            f"{config.batch_size}, seed {config.seed}, SGD lr {lr:g} on both sides, dropout off on both sides"]


@dataclass
class _Side:
    """The single-process side of one check, and what the layout is compared on."""

    config: object
    batches: list
    ref: dict
    hazards: list[Hazard]
    spread: float
    labels: dict[int, str]


def _reference_side(config, train, steps: int, lr: float) -> _Side:
    if steps < 1:
        raise ConfigError(f"--steps {steps} is too small", hint="pass --steps 1 or more")
    batches = check_batches(config, train, steps)
    workload, model = config.task(), config.model()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kwargs = dict(seed=config.seed, lr=lr, precision=config.precision, device=device,
                  split=(config.parallel.dp, config.parallel.pipeline.n_microbatches))
    ref = reference_run(model, batches, workload.loss(), **kwargs)
    again = reference_run(model, batches, workload.loss(), **kwargs)
    net = build_sequential(model, seed=config.seed)  # the model's declared ties are one tensor here
    switched = {i: names for i, block in enumerate(net) if (names := quiet(block))}
    micro = plan_runs(config.batch_size // config.parallel.dp, config.parallel.pipeline.n_microbatches)[0].size
    ddp = config.parallel.dp > 1 and config.parallel.dp_mode == "ddp"
    hazards = static_hazards(net, switched, ref, ddp_replicas=ddp) + probe_hazards(net, batches[0][0], micro)
    reference_spread = spread(ref, again)
    if reference_spread > 0:
        hazards.append(_nondeterministic(reference_spread))
    labels = {i: type(block).__name__ for i, block in enumerate(net)}
    return _Side(config, batches, ref, hazards, reference_spread, labels)


def run_checks(jobs: list[tuple], *, steps: int = DEFAULT_STEPS, lr: float = DEFAULT_LR,
               work_dir: Path | None = None) -> list[CheckReport]:
    """Check each `(config, train data)` of `jobs`: the layouts of one world size run on one spawned set of
    local ranks (one after another), each compared with the unsplit model run in this process."""
    with _one_thread():
        sides = [_reference_side(config, train, steps, lr) for config, train in jobs]
    records: dict[int, list[dict] | str] = {}
    for world in sorted({side.config.parallel.world_size for side in sides}):
        chosen = [i for i, side in enumerate(sides) if side.config.parallel.world_size == world]
        with tempfile.TemporaryDirectory(dir=work_dir) as out:
            try:
                runs = layout_runs([(sides[i].config, sides[i].batches) for i in chosen], lr=lr, out=Path(out))
            except RankFailedError as err:
                if len(chosen) > 1:  # which layout crashed is unknown: say it the plain way
                    raise
                runs = [_crash_line(err)]
        records.update(zip(chosen, runs))
    return [_report(side, records[i], steps, lr) for i, side in enumerate(sides)]


def _crash_line(err: RankFailedError) -> str:
    """The layout's error in one line: the first exception line of the rank's traceback, or its message."""
    text = err.message
    found = re.search(r"^(\w+(Error|Exception)): (.+)$", text, flags=re.MULTILINE)
    line = f"{found.group(1)}: {found.group(3)}" if found else text.strip().splitlines()[-1]
    return line if len(line) <= 300 else line[:297] + "..."


def run_check(config, train, *, steps: int = DEFAULT_STEPS, lr: float = DEFAULT_LR,
              work_dir: Path | None = None) -> CheckReport:
    """Compare `steps` steps of `config`'s layout (spawned local ranks) with the unsplit model in this process."""
    return run_checks([(config, train)], steps=steps, lr=lr, work_dir=work_dir)[0]


def _report(side: _Side, records: list[dict] | str, steps: int, lr: float) -> CheckReport:
    config = side.config
    crashed = records if isinstance(records, str) else None
    balance = (config.parallel.pipeline.balance or ("?",)) if crashed else records[0]["balance"]
    header = _header(config, steps, lr, balance)
    if config.parallel.tp > 1 and not crashed:
        header.append(_split_line(records, len(side.ref["params"][0]), config.parallel.tp))
    return CheckReport(header=header, precision=config.precision,
                       tolerances=TOLERANCES[config.precision], labels=side.labels,
                       steps=[] if crashed else step_diffs(side.ref, records), hazards=side.hazards,
                       reference_spread=side.spread, crashed=crashed)


def _split_line(records: list[dict], total: int, tp: int) -> str:
    """What the model's TP plan split, over every rank: a plan that splits nothing is said, not hidden."""
    split = set().union(*(record.get("tp_split", ()) for record in records))
    if not split:
        return f"tensor parallel: tp={tp} but the model's tp_plan split no parameter (every block kept whole)"
    return (f"tensor parallel: {len(split)} of {total} parameter tensors split over tp={tp} by the model's tp_plan "
            "(compared whole: shards gathered), the others replicated")


@contextmanager
def _one_thread() -> Iterator[None]:
    """One CPU thread for the reference, as each rank has (on a busy machine, many threads spin for nothing)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _nondeterministic(value: float) -> Hazard:
    return Hazard("non-determinism", None, f"two runs of the reference in one process differ by {value:.1e} "
                                           "(non-deterministic kernels, or state kept across runs)", cause=True)

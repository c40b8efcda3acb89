"""A job restarted with another number of ranks (`--on-resize auto|stop`): what the checkpoint's layout was, whether to
go on, the layout for the ranks there are now, and the one line that says it (pure: plain data in, no processes).

A torchrun elastic agent (`--nnodes MIN:MAX --max-restarts N`) or a Slurm requeue (`--nodes MIN-MAX`) restarts every
rank of a job after a host is lost or comes back, with the world it now has. The checkpoint to resume records the
layout that wrote it (`pipetrain.json`: its `layout` and the job's `config`); checkpoints are layout-free, so any
layout of the new world resumes it exactly. `decide` compares the two worlds: the same, nothing to do; another one
under `stop`, one ConfigError saying what changed; under `auto`, the planner's choice for the new world (`choose`:
`plan.auto.choose_layout` within the flags given), or, when no layout of that world can hold the job, one
ConfigError naming the smallest world that can.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pipetrain.errors import ConfigError
from pipetrain.plan.auto import Fixed
from pipetrain.plan.predict import Layout, Prediction

__all__ = ["RESIZE_POLICIES", "Saved", "Resize", "decide", "describe_layout", "smallest_world", "check_fixed_world"]

#: `--on-resize`: `auto` re-lays-out a job whose ranks changed since its checkpoint, `stop` ends it with a message.
RESIZE_POLICIES = ("auto", "stop")


@dataclass(frozen=True, kw_only=True)
class Saved:
    """The checkpoint a restart resumes: its folder, step, model (name and parameter fingerprint) and the layout
    (a `Layout`, its world `layout.world_size`) that wrote it."""

    folder: str
    step: int
    model: str
    fingerprint: str
    layout: Layout

    @classmethod
    def from_meta(cls, folder: str, *, step: int, model: str, fingerprint: str, layout: Mapping[str, Any],
                  config: Mapping[str, Any], world_size: int) -> Saved:
        """From a checkpoint's metadata (`checkpoint.folders.CheckpointMeta` fields): `layout` the engine's record,
        `config` the job's description as JSON (its `parallel` section has what the record leaves out)."""
        parallel = config.get("parallel", {}) if isinstance(config, Mapping) else {}
        pipeline = parallel.get("pipeline", {})
        pp, dp, cp = int(layout.get("pp", 1)), int(layout.get("dp", 1)), int(layout.get("cp", 1) or 1)
        tp = max(1, world_size // max(1, dp * pp * cp))
        return cls(folder=folder, step=step, model=model, fingerprint=fingerprint, layout=Layout(
            dp=dp, pp=pp, tp=tp, cp=cp, cp_attention=str(parallel.get("cp_attention", "ring")),
            batch=int(config.get("batch_size", 1) or 1),
            chunks=int(pipeline.get("n_microbatches", 1) or 1), schedule=str(layout.get("schedule", "1f1b")),
            virtual=max(1, int(layout.get("virtual_stages", 1) or 1)),
            checkpoint=str(pipeline.get("checkpoint", "never")), dp_mode=str(parallel.get("dp_mode", "ddp"))))


@dataclass(frozen=True)
class Resize:
    """A re-layout: the checkpoint's layout, the chosen one and its step time relative to the old (None: unknown)."""

    old: Layout
    new: Prediction
    ratio: float | None

    def line(self) -> str:
        """"4 → 2 ranks: dp2 × pp2 → pp2, chunks 8; predicted 1.9× the step time" (what changed, and the cost)."""
        old, new = self.old, self.new.layout
        said = f"{describe_layout(old)} → {describe_layout(new)}"
        if new.chunks != old.chunks:
            said += f", chunks {new.chunks}"
        if new.schedule != old.schedule:
            said += f", schedule {new.schedule}"
        cost = "" if self.ratio is None else f"; predicted {self.ratio:.1f}× the step time"
        return f"{old.world_size} → {new.world_size} ranks: {said}{cost}"


def describe_layout(layout: Layout) -> str:
    """`dp2 × pp2`, `pp2`, `dp4`, `dp2 × pp2 × tp2`, `pp2 × cp2`; `1 rank` when nothing is split."""
    sizes = (("dp", layout.dp), ("pp", layout.pp), ("tp", layout.tp), ("cp", layout.cp))
    parts = [f"{name}{size}" for name, size in sizes if size > 1]
    return " × ".join(parts) or "1 rank"


def _ranks(count: int) -> str:
    return f"{count} rank{'s' if count != 1 else ''}"


def _given(fixed: Fixed) -> str:
    flags = {"pp": "--pp", "dp": "--dp", "dp_mode": "--dp-mode", "schedule": "--schedule", "chunks": "--chunks",
             "checkpoint": "--checkpoint", "virtual": "--stages-per-rank", "balance": "--partition", "ep": "--ep",
             "cp": "--cp", "cp_attention": "--cp-attention", "dp_shard": "--dp-shard", "moe_overlap": "--moe-overlap"}
    return " ".join(f"{flags[name]} {('on' if value else 'off') if isinstance(value, bool) else value}"
                    for name, value in vars(fixed).items() if value is not None)


def check_fixed_world(fixed: Fixed, tp: int = 1) -> None:
    """`--on-resize auto` with flags that fix the whole world (both --dp and --pp): no other world can be laid out."""
    if fixed.dp is not None and fixed.pp is not None:
        world = fixed.dp * fixed.pp * tp
        raise ConfigError(f"--on-resize auto with --dp {fixed.dp} --pp {fixed.pp}: these flags fix the job at "
                          f"{_ranks(world)}, so no smaller world satisfies them",
                          hint="drop --dp (or --pp): the planner then chooses it for the ranks the job has after a "
                               "restart; or drop --on-resize auto")


def smallest_world(choose: Callable[[int], Prediction], *, up_to: int, skip: int = 0) -> int | None:
    """The fewest ranks (1..`up_to`, `skip` left out: already tried) for which `choose` finds a layout, or None."""
    for world in range(1, up_to + 1):
        if world == skip:
            continue
        try:
            choose(world)
        except ConfigError:
            continue
        return world
    return None


def decide(saved: Saved | None, *, world: int, policy: str, model: str, fingerprint: str,
           choose: Callable[[int], Prediction], price: Callable[[Layout], float | None] = lambda layout: None,
           fixed: Fixed = Fixed()) -> Resize | None:
    """The re-layout of a job of `world` ranks resuming `saved` (None: a fresh start, nothing to compare), or None
    when the world is the checkpoint's. `model` and `fingerprint` are this job's model (a checkpoint of another
    model stops it); `choose(world)` the planner's prediction for a world (ConfigError: none fits), `price(layout)`
    a layout's predicted step time (None: not known), `fixed` the flags given (said in the messages)."""
    if policy not in RESIZE_POLICIES:
        raise ConfigError(f"--on-resize {policy!r} is not a policy", hint=f"pass one of {', '.join(RESIZE_POLICIES)}")
    if saved is None:
        return None
    if saved.model != model or saved.fingerprint != fingerprint:
        what = (f"model {saved.model!r}, this job trains {model!r}" if saved.model != model
                else "parameters of another shape than this job's model")
        raise ConfigError(f"the restart resumes checkpoint {saved.folder!r} (step {saved.step}, "
                          f"{_ranks(saved.layout.world_size)}), which holds {what}",
                          hint="restart with the workload, preset and model flags that wrote it, or pass another "
                               "--save-dir")
    old = saved.layout
    if world == old.world_size:
        return None
    changed = f"{_ranks(old.world_size)} → {world}: checkpoint {saved.folder!r} (step {saved.step}) was written by " \
              f"{describe_layout(old)}"
    if policy == "stop":
        raise ConfigError(f"the job's ranks changed since its checkpoint: {changed}, and --on-resize is stop",
                          hint=f"pass --on-resize auto to let the planner lay out the {_ranks(world)} (the layout "
                               f"flags given stay constraints), or start {_ranks(old.world_size)} again")
    try:
        new = choose(world)
    except ConfigError as err:
        least = smallest_world(choose, up_to=4 * max(world, old.world_size), skip=world)
        constraints = f" with {_given(fixed)}" if _given(fixed) else ""
        if least is None:
            raise ConfigError(f"{changed}; no layout of {_ranks(world)}{constraints} can hold the job, nor of any "
                              f"world up to {4 * max(world, old.world_size)} ranks: {err.message}",
                              hint=err.hint) from None
        raise ConfigError(f"{changed}; no layout of {_ranks(world)}{constraints} can hold the job ({err.message}): "
                          f"the smallest world that works is {_ranks(least)}",
                          hint=f"restart with {least} ranks or more (torchrun: --nnodes MIN:MAX with MIN × "
                               f"--nproc-per-node >= {least}; Slurm: --nodes MIN-MAX likewise)"
                               + (", or drop some of the layout flags" if constraints else "")) from None
    before = price(old)
    ratio = new.step_s / before if before else None
    return Resize(old, new, ratio)

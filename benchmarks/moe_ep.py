"""Benchmark: a MoE training step at dp 2 × pp 2 with its experts whole (ep 1), split over 2 ranks (ep 2), split with
the all-to-alls replaced by a local copy of the same shape (ep 2, no all-to-all), and under DualPipeV with its fused
forward-and-backward actions overlapped or not (`--moe-overlap`), side by side in one run.

One spawned job of 4 gloo ranks (one thread each) builds the sessions of the same tiny-but-not-trivial Qwen3-MoE
(`--hidden 256`, `--experts 8`, top 2, `--layers 4`, from its transformers config, random weights), then times
`--steps` steps of each, all alternating, `--repeats` times (after one warm-up round), and prints the tokens/s of
each: the median and the spread (min-max) over the repeats, and step-time ratios paired within each repeat, which a
loaded machine's drift moves less. `--schedules 1f1b` times ep 1, ep 2 and ep 2 without all-to-all under 1F1B with
DDP (2 micro-batches); `--schedules dualpipev` times ep 2 under DualPipeV with FSDP2 (DDP is refused there;
`--dualpipev-chunks` micro-batches) four ways: overlapped, in turn, and each without the all-to-all; the default
runs both sets.

"no all-to-all" is a measurement knob of this script only, not a pipetrain option: during its steps,
`pipetrain.moe.dispatch`'s `all_to_all_single` is replaced by a copy of the rank's own rows (the counts a rank
sends stand for those it receives, so every exchanged tensor keeps its size and the experts do the same work on
other rows). The difference between ep 2 and ep 2 without the all-to-all is what the all-to-alls cost in the step:
what an overlap could at most hide. The steps with the all-to-all also clock each `all_to_all_single` call (the
seconds a rank spends inside them, waiting for its peers included, and the calls a step): a direct figure, far less
moved by the machine's drift than the difference of two step times.

`--calibration FILE...` prints the planner's step time for each layout beside the measured one (`plan.predict` on
the model's config.json, the median over the files' predictions; "no all-to-all": the same layout with every expert
exchange free; overlapped: `Layout.moe_overlap`, plan/overlap.py) and its ratios beside the paired ones, and the
all-to-alls' planned seconds a step with and without the calibrated fixed cost per call (`Network.ep_all_to_all_s`);
`--calibrate` first measures each file not there yet at the model's width.
Run: `PYTHONPATH=src .venv/bin/python benchmarks/moe_ep.py [--schedules dualpipev] [--repeats 5] [--steps 4]
[--calibrate --calibration A.json]`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from unittest.mock import patch

import torch
import torch.distributed as dist

from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.launch.env import free_port
from pipetrain.launch.spawn import RankSpec, spawn
from pipetrain.moe import dispatch as moe_dispatch
from pipetrain.plan import experts as plan_experts
from pipetrain.plan.hardware import load_calibration, save_calibration
from pipetrain.plan import stage_costs as plan_stage_costs
from pipetrain.plan.predict import Layout, predict
from pipetrain.plan.transformer import load_sizes
from pipetrain.session import build_session, close_session, join_job
from pipetrain.workloads.hf.causal_lm import HFCausalLM

#: name -> (ep, schedule, --moe-overlap, all-to-all removed), by `--schedules` set
VARIANTS = {
    "1f1b": {"ep1": (1, "1f1b", False, False), "ep2": (2, "1f1b", False, False),
             "ep2 no all-to-all": (2, "1f1b", False, True)},
    "dualpipev": {"dualpipev ep2 overlap": (2, "dualpipev", True, False),
                  "dualpipev ep2": (2, "dualpipev", False, False),
                  "dualpipev ep2 overlap, no all-to-all": (2, "dualpipev", True, True),
                  "dualpipev ep2 no all-to-all": (2, "dualpipev", False, True)},
}
#: step-time ratios printed, paired within each repeat
RATIOS = (("ep2", "ep1"), ("ep2", "ep2 no all-to-all"), ("dualpipev ep2 overlap", "dualpipev ep2"),
          ("dualpipev ep2", "dualpipev ep2 no all-to-all"),
          ("dualpipev ep2 overlap", "dualpipev ep2 no all-to-all"),
          ("dualpipev ep2 overlap, no all-to-all", "dualpipev ep2 no all-to-all"))


def _variants(which: str) -> dict[str, tuple[int, str, bool, bool]]:
    return {name: v for key, group in VARIANTS.items() if which in ("all", key) for name, v in group.items()}


def _model(args: argparse.Namespace) -> HFCausalLM:
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=args.hidden // 4, intermediate_size=4 * args.hidden,
        moe_intermediate_size=args.hidden, num_experts=args.experts, num_experts_per_tok=2,
        max_position_embeddings=args.seq, output_router_logits=False)
    return HFCausalLM(config, seq_len=args.seq)


def _local_all_to_all(out: torch.Tensor, rows: torch.Tensor, *args, **kwargs) -> None:
    """The measurement knob: the rank's own rows in place of what the all-to-all would bring (same size)."""
    out.copy_(rows)


@contextmanager
def _without_all_to_all():
    real = moe_dispatch.dist
    moe_dispatch.dist = SimpleNamespace(all_to_all_single=_local_all_to_all, get_world_size=real.get_world_size)
    try:
        yield
    finally:
        moe_dispatch.dist = real


class _Clocked:
    """The measurement's clock on the all-to-alls: the seconds each `all_to_all_single` call of `moe.dispatch` takes
    on this rank (waiting for its peers included), one entry a call (appends are safe from two threads)."""

    def __init__(self, real) -> None:
        self.real, self.spans = real, []
        self.get_world_size = real.get_world_size

    def all_to_all_single(self, *args, **kwargs) -> None:
        start = time.perf_counter()
        self.real.all_to_all_single(*args, **kwargs)
        self.spans.append(time.perf_counter() - start)


@contextmanager
def _clocked(clock: _Clocked):
    real = moe_dispatch.dist
    moe_dispatch.dist = clock
    try:
        yield
    finally:
        moe_dispatch.dist = real


def _parallel(ep: int, schedule: str, overlap: bool, chunks: int) -> ParallelConfig:
    pipeline = PipelineConfig(pp=2, schedule=schedule, n_microbatches=chunks if schedule == "dualpipev" else 2,
                              moe_overlap=overlap)
    return ParallelConfig(dp=2, ep=ep, dp_mode="fsdp" if schedule == "dualpipev" else "ddp", pipeline=pipeline)


def _worker(spec: RankSpec, args: argparse.Namespace, out: str) -> None:
    device = join_job(spec)
    try:
        model = _model(args)
        variants = _variants(args.schedules)
        sessions = {name: build_session(model, _parallel(ep, schedule, overlap, args.dualpipev_chunks), device,
                                        seed=0, loss_fn=model.loss())
                    for name, (ep, schedule, overlap, _) in variants.items()}
        dp_rank = next(iter(sessions.values())).mesh.dp_rank
        gen = torch.Generator().manual_seed(dp_rank)
        ids = torch.randint(0, args.vocab, (args.batch // 2, args.seq), generator=gen)
        times: dict[str, list[float]] = {name: [] for name in variants}
        inside: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}  # (s, calls) a step
        for repeat in range(args.repeats + 1):  # the first round warms up
            for name, session in sessions.items():
                clock = _Clocked(moe_dispatch.dist)
                knob = _without_all_to_all() if variants[name][3] else _clocked(clock)
                dist.barrier()
                start = time.perf_counter()
                with knob:
                    for _ in range(args.steps):
                        session.engine.step(ids, ids)
                dist.barrier()
                if repeat:
                    times[name].append((time.perf_counter() - start) / args.steps)
                    inside[name].append((sum(clock.spans) / args.steps, len(clock.spans) / args.steps))
        ranks: list = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, inside)
        if spec.rank == 0:
            torch.save({"times": times, "inside": ranks}, Path(out) / "times.pt")
    finally:
        close_session()


def _print_inside(name: str, inside: list, planned_s: float) -> None:
    """The seconds a rank spent inside the all-to-all calls per step (the mean over the ranks; the median over the
    repeats, min-max), the calls a step and the seconds a call, beside the planned all-to-all seconds a step."""
    per_repeat = [statistics.fmean(rank[name][r][0] for rank in inside) for r in range(len(inside[0][name]))]
    calls = statistics.fmean(rank[name][0][1] for rank in inside)
    middle = statistics.median(per_repeat)
    print(f"  inside the all-to-all calls ({name}): {middle:.3f} s a step per rank (min {min(per_repeat):.3f}, max "
          f"{max(per_repeat):.3f}), {calls:.0f} calls a step, {1e3 * middle / calls:.2f} ms a call"
          + (f" | planned {planned_s:.3f} s a step" if planned_s else ""))


def _share(with_: float, without: float) -> str:
    """The all-to-alls' seconds and share of a planned step."""
    return f"{with_ - without:.3f} s of the step ({100 * (with_ - without) / with_:.0f} %)"


@contextmanager
def _nothing():
    yield


def add_model_arguments(parser: argparse.ArgumentParser, *, steps: int) -> None:
    """The benchmark model's sizes and the timing flags (shared with plan_moe_cpu.py)."""
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="global batch (samples; 2 replicas x 2 micro-batches)")
    parser.add_argument("--steps", type=int, default=steps, help="steps timed together")
    parser.add_argument("--repeats", type=int, default=5)


def calibrations(args: argparse.Namespace) -> list:
    """The `--calibration` files' figures, each measured first at the model's width (a layer of hidden, the top-k
    experts' width as its feed-forward, the sequence length) with `--calibrate` where it is not there yet."""
    for path in args.calibration if args.calibrate else ():
        if not path.exists():
            from pipetrain.bench.calibrate import calibrate

            shape = dict(seq_len=args.seq, emsize=args.hidden, nhead=4, nhid=2 * args.hidden, dropout=0.0)
            save_calibration(calibrate(shape, samples=32, device="cpu"), path)
    return [load_calibration(path) for path in args.calibration]


def planned(args: argparse.Namespace, variant: tuple[int, str, bool, bool], calibration, hides: bool = False,
            fixed: bool = True) -> float:
    """The planner's step seconds of one variant (dp 2 x pp 2 as `_parallel` lays it out) on `calibration`;
    `hides`: with the GPU's rule (each fused pair hides min(X, C) per side) in place of the CPU's (nothing hidden);
    not `fixed`: without the calibrated fixed cost per all-to-all call (`Network.ep_all_to_all_s` 0, as before it
    was measured)."""
    ep, schedule, overlap, bare = variant
    if not fixed:
        calibration = replace(calibration, network=replace(calibration.network, ep_all_to_all_s=0.0))
    with tempfile.TemporaryDirectory() as folder:
        _model(args).config.save_pretrained(folder)
        blocks = load_sizes(folder).blocks(args.seq, element=4)
    dualpipev = schedule == "dualpipev"
    layout = Layout(dp=2, pp=2, batch=args.batch, chunks=args.dualpipev_chunks if dualpipev else 2,
                    schedule=schedule, virtual=2 if dualpipev else 1, dp_mode="fsdp" if dualpipev else "ddp", ep=ep,
                    moe_overlap=overlap)
    with patch.object(plan_experts, "_a2a_s", lambda *_: 0.0) if bare else _nothing(), \
            patch.object(plan_stage_costs, "overlap_hides", lambda _: True) if hides else _nothing():
        return predict(blocks, layout, calibration.device, calibration.network).step_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, steps=4)
    parser.add_argument("--schedules", choices=("all", *VARIANTS), default="all",
                        help="which set of layouts to time (default: both)")
    parser.add_argument("--dualpipev-chunks", type=int, default=8, help="micro-batches under DualPipeV")
    parser.add_argument("--calibration", type=Path, nargs="+", default=[],
                        help="calibration files: print the planner's step time of each layout beside the measured")
    parser.add_argument("--calibrate", action="store_true",
                        help="first calibrate this machine at the model's width into each --calibration file not there")
    args = parser.parse_args()
    calibs = calibrations(args)
    with tempfile.TemporaryDirectory() as out:
        spawn(_worker, ranks=range(4), world_size=4, master_addr="127.0.0.1", master_port=free_port(),
              args=(args, out), timeout_s=3600)
        saved = torch.load(Path(out) / "times.pt")
    times, inside = saved["times"], saved["inside"]
    tokens = args.batch * args.seq
    print(f"Qwen3-MoE hidden {args.hidden}, {args.experts} experts top-2, {args.layers} layers, vocab {args.vocab}; "
          f"dp 2 x pp 2 (1F1B: DDP, 2 micro-batches; DualPipeV: FSDP2, {args.dualpipev_chunks} micro-batches), "
          f"{tokens} tokens a step; gloo, 1 thread a rank; torch {torch.__version__}; median (min-max) of "
          f"{args.repeats} repeats of {args.steps} steps")
    plans = {name: statistics.median(planned(args, variant, c) for c in calibs)
             for name, variant in _variants(args.schedules).items()} if calibs else {}
    print(f"{'layout':>38} {'s/step':>8} {'tokens/s':>9} {'tokens/s min-max':>17}"
          + (f" {'planned s/step':>14} {'error':>7}" if plans else ""))
    for name, values in times.items():
        rates = [tokens / t for t in values]
        step = statistics.median(values)
        print(f"{name:>38} {step:8.3f} {statistics.median(rates):9.0f} {min(rates):8.0f}-{max(rates):<8.0f}"
              + (f" {plans[name]:14.3f} {100 * (plans[name] - step) / step:+6.1f}%" if plans else ""))
    for with_, without in (("ep2", "ep2 no all-to-all"), ("dualpipev ep2", "dualpipev ep2 no all-to-all")):
        if with_ in times:
            a, b = statistics.median(times[with_]), statistics.median(times[without])
            shares = [(x - y) / x for x, y in zip(times[with_], times[without])]
            print(f"all-to-alls ({with_}): {a - b:.3f} s of the step ({100 * (a - b) / a:.0f} %; paired per repeat: "
                  f"median {100 * statistics.median(shares):.0f} %, min {100 * min(shares):.0f} %, max "
                  f"{100 * max(shares):.0f} %)"
                  + (f" | planned {_share(plans[with_], plans[without])}" if plans else ""))
            _print_inside(with_, inside, plans.get(with_, 0.0) - plans.get(without, 0.0))
            if plans:
                variants = _variants(args.schedules)
                old = [statistics.median(planned(args, variants[n], c, fixed=False) for c in calibs)
                       for n in (with_, without)]
                fixed = statistics.median(c.network.ep_all_to_all_s for c in calibs)
                print(f"  planned without the calibrated fixed cost per call ({1e3 * fixed:.2f} ms a call and peer): "
                      f"{_share(*old)}; {with_} step {old[0]:.3f} s, error {100 * (old[0] - a) / a:+.1f}%")
    for a, b in RATIOS:  # paired within each repeat: less of the drift
        if a in times and b in times:
            ratios = [x / y for x, y in zip(times[a], times[b])]
            print(f"step time {a} / {b}, per repeat: median {statistics.median(ratios):.3f} "
                  f"(min {min(ratios):.3f}, max {max(ratios):.3f})"
                  + (f" | planned {plans[a] / plans[b]:.3f}" if plans else ""))
    if calibs:
        print(f"planned: median over {len(calibs)} calibration(s) {' '.join(map(str, args.calibration))}")
    overlapped = "dualpipev ep2 overlap"
    if calibs and overlapped in times:  # the rule not chosen for a CPU, for comparison with the measured ratio
        gpu = statistics.median(planned(args, VARIANTS["dualpipev"][overlapped], c, hides=True) for c in calibs)
        print(f"with the GPU's rule (each fused pair hides min(X, C) per side) the overlapped step would be planned at "
              f"{gpu:.3f} s, {gpu / plans['dualpipev ep2']:.3f} of the step in turn")

if __name__ == "__main__":
    main()

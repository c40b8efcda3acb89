"""Benchmark: the planner's mixture-of-experts figures against a measured CPU run, dp 2 x pp 2 at ep 1 and ep 2.

The model is `benchmarks/moe_ep.py`'s Qwen3-MoE (hidden 256, 8 experts top-2, 4 layers, vocab 2048, random
weights), run as there (1F1B, DDP, 2 micro-batches, fp32, gloo, one thread a rank), and priced from its config.json
as `pipetrain plan --model DIR --ep N` prices it. One spawned job of 4 ranks measures, per ep and per pipeline rank,
as `benchmarks/memory_modes.py` does (its counters): the bytes of the rank's parameters, gradients and AdamW state
(tensor by tensor) and the peak of the activations saved for backward (a saved-tensor hook around one step); then
it times `--steps` steps of ep 1 and ep 2 in turn, `--repeats` times after a warm-up round. The planner's figures
for the same layout (`plan.predict`, no device baseline): the parameters, gradients and AdamW state of the rank's
dense parts and expert shares (the DDP bucket, which aliases the gradients here, apart), the saved-activation peak
(the predicted peak less the static bytes, the receive buffers and the last stage's kept outputs, which no
saved-tensor hook sees) and the step time from one or more calibration files (the median of their predictions: a
calibration on this shared machine moves by 2-3x between runs minutes apart). `--calibrate` first measures each
file not there yet at the model's width (`pipetrain plan --calibrate` measures the `cpu` preset's 64-wide layer,
whose small matrix products run ~10x slower per FLOP than this model's).
Run: `PYTHONPATH=src .venv/bin/python benchmarks/plan_moe_cpu.py --calibrate --calibration A.json B.json C.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from unittest.mock import patch

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the benchmarks package beside src/

from benchmarks.memory_modes import MB, _release, measured_steps  # noqa: E402
from benchmarks.moe_ep import _model, _parallel, add_model_arguments, calibrations  # noqa: E402
from pipetrain.launch.env import free_port  # noqa: E402
from pipetrain.launch.spawn import RankSpec, spawn  # noqa: E402
from pipetrain.plan import loss as loss_terms  # noqa: E402
from pipetrain.plan.experts import expert_layout, rank_parts  # noqa: E402
from pipetrain.plan.hardware import default_calibration_path  # noqa: E402
from pipetrain.plan.predict import Layout, predict, static_bytes  # noqa: E402
from pipetrain.plan.schedules import rank_stages  # noqa: E402
from pipetrain.plan.transformer import load_sizes  # noqa: E402
from pipetrain.session import build_session, close_session, join_job  # noqa: E402

EPS = (1, 2)
CHUNKS = 2


def _memory(model, ep: int, device, ids: torch.Tensor) -> dict:
    """One ep's per-rank bytes: parameters, gradients, AdamW state, saved-activation peak (after a warm-up)."""
    _release()
    session = build_session(model, _parallel(ep, "1f1b", False, CHUNKS), device, seed=0, loss_fn=model.loss())
    engine = session.engine
    optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-4)
    record = {**measured_steps(engine, optimizer, [(ids, ids)] * 2), "pp_rank": session.mesh.pp_rank}
    del session, engine, optimizer
    _release()
    return record


def _worker(spec: RankSpec, args: argparse.Namespace, out: str) -> None:
    device = join_job(spec)
    try:
        model = _model(args)
        gen = torch.Generator().manual_seed(spec.rank // 2)  # dp rank: the mesh puts dp outermost
        ids = torch.randint(0, args.vocab, (args.batch // 2, args.seq), generator=gen)
        memory = {ep: _memory(model, ep, device, ids) for ep in EPS}
        sessions = {ep: build_session(model, _parallel(ep, "1f1b", False, CHUNKS), device, seed=0,
                                      loss_fn=model.loss()) for ep in EPS}
        times: dict[int, list[float]] = {ep: [] for ep in EPS}
        for repeat in range(args.repeats + 1):  # the first round warms up
            for ep, session in sessions.items():
                dist.barrier()
                start = time.perf_counter()
                for _ in range(args.steps):
                    session.engine.step(ids, ids)
                dist.barrier()
                if repeat:
                    times[ep].append((time.perf_counter() - start) / args.steps)
        (Path(out) / f"rank{spec.rank}.json").write_text(json.dumps({"memory": memory, "times": times}))
    finally:
        close_session()


def planned(folder: str, args: argparse.Namespace, ep: int, calibration) -> tuple[float, list[dict]]:
    """(predicted step seconds, per pipeline rank: parameters, gradients, AdamW state, DDP bucket and
    saved-activation bytes the planner counts) for dp 2 x pp 2 1F1B DDP at `ep`."""
    blocks = load_sizes(folder).blocks(args.seq, element=4)
    layout = Layout(dp=2, pp=2, batch=args.batch, chunks=CHUNKS, schedule="1f1b", dp_mode="ddp", ep=ep)
    device = replace(calibration.device, baseline_bytes=0.0, activation_factor=1.0, memory_bytes=1e15)
    step = predict(blocks, layout, calibration.device, calibration.network).step_s
    # the last stage's outputs (held from each forward to its backward) and the loss backward's temporaries are no
    # saved activations: the saved-tensor hook sees neither (as in memory_modes.py)
    with patch.object(loss_terms, "BACKWARD_TEMPORARIES", 0):
        bare = predict(blocks[:-1] + [replace(blocks[-1], output_bytes=0.0)], layout, device, calibration.network)
    samples = args.batch // 2 // CHUNKS
    bounds, start = [], 0
    for count in bare.balance:
        bounds.append((start, start + count))
        start += count
    inputs = [samples * (blocks[a - 1].output_bytes if a else 0.0) for a, _ in bounds]
    ranks = []
    for rank in range(2):
        held = rank_stages(rank, 2, 1, "loop")
        dense, shares = rank_parts([blocks[i] for s in held for i in range(*bounds[s])], ep)
        params = sum(b.param_bytes for b in dense + shares)
        bucket = sum(b.param_bytes for b in dense) + (sum(b.param_bytes for b in shares) if 2 // ep > 1 else 0.0)
        buffers = CHUNKS * sum(inputs[s] + (inputs[s + 1] if s + 1 < len(inputs) else 0.0) for s in held)
        static = static_bytes(dense, layout) + (static_bytes(shares, expert_layout(layout)) if shares else 0.0)
        ranks.append({"params": params, "grads": params, "optimizer": 2 * params, "bucket": bucket,
                      "saved": bare.memory_bytes[rank] - static - buffers})
    return step, ranks


def _spread(values: list[float]) -> str:
    median = statistics.median(values)
    return f"{median:.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, steps=3)
    parser.add_argument("--calibration", type=Path, nargs="+", default=[default_calibration_path()],
                        help="one or more calibration files (several: each one's prediction and their median)")
    parser.add_argument("--calibrate", action="store_true",
                        help="first calibrate this machine at the model's width (a layer of hidden, the top-k experts' "
                             "width as its feed-forward, the sequence length) into each --calibration file not there")
    args = parser.parse_args()
    calibs = calibrations(args)
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as out:
        spawn(_worker, ranks=range(4), world_size=4, master_addr="127.0.0.1", master_port=free_port(),
              args=(args, out), timeout_s=3600)
        ranks = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(4)]
    with tempfile.TemporaryDirectory() as folder:
        _model(args).config.save_pretrained(folder)
        plans = {ep: [planned(folder, args, ep, c) for c in calibs] for ep in EPS}
    print(f"Qwen3-MoE hidden {args.hidden}, {args.experts} experts top-2, {args.layers} layers, vocab {args.vocab}; "
          f"dp 2 x pp 2, 1F1B, DDP, {CHUNKS} micro-batches of {args.batch // 2 // CHUNKS} x {args.seq}, fp32, AdamW; "
          f"calibrations {' '.join(map(str, args.calibration))}; load average before {load[0]:.1f}, after "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'ep':>2} {'rk':>2} {'term':<10} {'measured MB':>11} {'planned MB':>10} {'error':>7}")
    for ep in EPS:
        _, plan = plans[ep][0]  # memory does not depend on the calibration here (no device baseline)
        for r in range(2):  # the first replica's ranks: one per pipeline rank
            rec = ranks[r]["memory"][str(ep)]
            want = plan[rec["pp_rank"]]
            for term in ("params", "grads", "optimizer", "saved"):
                got = rec[term]
                print(f"{ep:>2} {r:>2} {term:<10} {got / MB:>11.3f} {want[term] / MB:>10.3f} "
                      f"{100 * (want[term] - got) / got:>+6.1f}%")
            print(f"{ep:>2} {r:>2} {'ddp bucket':<10} {'-':>11} {want['bucket'] / MB:>10.3f}")
    print(f"step seconds: measured median (min-max) of {args.repeats} repeats of {args.steps} steps | predicted: "
          "the median over the calibrations (each one's)")
    steps = {ep: [step for step, _ in plans[ep]] for ep in EPS}
    for ep in EPS:
        measured = ranks[0]["times"][str(ep)]
        step, median = statistics.median(steps[ep]), statistics.median(measured)
        print(f"ep {ep}: {_spread(measured)} | {step:.3f} ({100 * (step - median) / median:+.1f}%) "
              f"({' '.join(f'{s:.3f}' for s in steps[ep])})")
    ratios = [a / b for a, b in zip(ranks[0]["times"]["2"], ranks[0]["times"]["1"])]
    predicted = statistics.median(steps[2]) / statistics.median(steps[1])
    print(f"step ep2 / ep1, paired per repeat: measured median {statistics.median(ratios):.3f} "
          f"({min(ratios):.3f}-{max(ratios):.3f}) | predicted {predicted:.3f}")


if __name__ == "__main__":
    main()

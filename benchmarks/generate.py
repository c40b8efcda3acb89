"""Generation through the pipeline beside transformers' `generate`, side by side: tokens/s and what the split costs.

The same 4 prompts of different lengths (one left-padded batch), greedy, `--new` new tokens, on one model folder
(default: SmolLM2-135M-Instruct, `make smollm2`). Layouts: transformers' `model.generate` on the unsplit model in
this process; pipetrain's loop on the unsplit model in one process (`pp1`: the same blocks and cache, no split);
pp=2 (2 ranks) and pp=2 × tp=3 (6 ranks; pp2xtp2 for a model whose heads 2 divides), each in its own spawned job, one job at a time. Every layout runs one
untimed generation, then `--repeats` timed ones (median). Printed per layout: whether its tokens equal
transformers' (token for token), seconds, tokens/s and its ratio to transformers', and seconds per decoding step;
then the split's cost per step over the unsplit pipetrain loop, divided by the boundary hops a step makes (pp - 1
hidden-state sends and one token broadcast), and a bare hop timed alone between 2 ranks (`--hops` round trips). One thread per rank and for transformers (`torch.set_num_threads(1)`),
so a rank's compute is the same in every layout; on a machine with fewer cores than ranks the ranks share cores.

    python benchmarks/generate.py [--model DIR] [--new 32] [--repeats 3] [--layouts pp1 pp2 pp2xtp3] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pipetrain.generate.job import GenerateJob, build_stage, eos_ids, generate_batch, prepare_job
from pipetrain.generate.loop import Placement
from pipetrain.generate.weights import model_source
from pipetrain.launch.env import free_port
from pipetrain.launch.spawn import RankSpec, spawn
from pipetrain.parallel.mesh import build_mesh
from pipetrain.session import close_session, join_job
from pipetrain.workloads.hf.smollm2 import prepare
from pipetrain.workloads.hf.text import load_tokenizer

PROMPTS = ("The capital of France is",
           "Write one sentence about the sea.",
           "Once upon a time, in a small village at the edge of a great forest, there lived",
           "List three colours:")
#: layout -> (pp, tp)
#: (SmolLM2-135M's 9 query and 3 key/value heads split over 3 tensor-parallel ranks, not 2)
LAYOUTS = {"pp1": (1, 1), "pp2": (2, 1), "pp2xtp2": (2, 2), "pp2xtp3": (2, 3)}


def _job(folder: str, new: int, pp: int, tp: int) -> GenerateJob:
    return GenerateJob(model_source(folder, None), PROMPTS, pp=pp, tp=tp, max_new_tokens=new)


def _timed(run, repeats: int) -> tuple[torch.Tensor, list[float]]:
    tokens, _ = run()  # untimed: first-call costs (allocations, mask creation's imports)
    times = []
    for _ in range(repeats):
        tokens, seconds = run()
        times.append(seconds)
    return tokens, times


def _rank(spec: RankSpec, folder: str, new: int, pp: int, tp: int, repeats: int, out: str) -> None:
    device = join_job(spec)
    try:
        job = _job(folder, new, pp, tp)
        model, batch = prepare_job(job)
        mesh = build_mesh(1, pp, device, tp) if tp > 1 else None
        where = Placement(spec.rank, pp, tp)
        stage = build_stage(model, where, device, tp_mesh=None if mesh is None else mesh.tp_mesh)

        def run():
            done = generate_batch(job, stage, where, batch, model)
            return done.tokens, done.seconds

        tokens, times = _timed(run, repeats)
        if spec.rank == 0:
            Path(out).write_text(json.dumps({"tokens": tokens.tolist(), "times": times}))
    finally:
        close_session()


def _hops(spec: RankSpec, hidden: int, batch: int, rounds: int, out: str) -> None:
    """Rank 0 and 1: `rounds` round trips of a decoding step's hidden states `[batch, 1, hidden]` (fp32), then
    `rounds` broadcasts of `batch` token ids from rank 1, as the loop makes them; rank 0 writes the medians."""
    import torch.distributed as dist

    join_job(spec)
    try:
        hidden_states, ids = torch.zeros(batch, 1, hidden), torch.zeros(batch, dtype=torch.long)
        trips, casts = [], []
        for _ in range(rounds):
            dist.barrier()
            start = time.perf_counter()
            if spec.rank == 0:
                dist.send(hidden_states, dst=1)
                dist.recv(hidden_states, src=1)
            else:
                dist.recv(hidden_states, src=0)
                dist.send(hidden_states, dst=0)
            trips.append(time.perf_counter() - start)
            dist.barrier()
            start = time.perf_counter()
            dist.broadcast(ids, src=1)
            casts.append(time.perf_counter() - start)
        if spec.rank == 0:
            Path(out).write_text(json.dumps({"hop_s": statistics.median(trips) / 2,
                                             "broadcast_s": statistics.median(casts)}))
    finally:
        close_session()


def _transformers(folder: str, new: int, repeats: int) -> tuple[torch.Tensor, list[float]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    pipetrain_model, batch = prepare_job(_job(folder, new, 1, 1))
    tokenizer = load_tokenizer(Path(folder))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else \
        eos_ids(Path(folder), pipetrain_model.config, tokenizer)[0]

    def run():
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(batch.ids, attention_mask=batch.mask, max_new_tokens=new, do_sample=False,
                                 pad_token_id=pad)
        return out[:, batch.ids.shape[1]:], time.perf_counter() - start

    return _timed(run, repeats)


def _pipetrain_unsplit(folder: str, new: int, repeats: int) -> tuple[torch.Tensor, list[float]]:
    job = _job(folder, new, 1, 1)
    model, batch = prepare_job(job)
    stage = build_stage(model, Placement(0, 1), torch.device("cpu"))

    def run():
        done = generate_batch(job, stage, Placement(0, 1), batch, model)
        return done.tokens, done.seconds

    return _timed(run, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a Hugging Face folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--new", type=int, default=32, help="new tokens per prompt (default: 32)")
    parser.add_argument("--repeats", type=int, default=3, help="timed generations per layout (default: 3)")
    parser.add_argument("--layouts", nargs="+", default=["pp1", "pp2", "pp2xtp3"], choices=list(LAYOUTS),
                        help="default: pp1 pp2 pp2xtp3 (tp must divide the model's heads: SmolLM2's 9 and 3)")
    parser.add_argument("--hops", type=int, default=200,
                        help="also time this many bare boundary hops between 2 ranks (0: none; default: 200)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    folder = args.model or str(prepare())
    torch.set_num_threads(1)
    reference, times = _transformers(folder, args.new, args.repeats)
    steps = reference.shape[1]
    rows = {"transformers": (reference, times)}
    for layout in args.layouts:
        pp, tp = LAYOUTS[layout]
        if pp * tp == 1:
            rows[layout] = _pipetrain_unsplit(folder, args.new, args.repeats)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "rank0.json"
            spawn(_rank, ranks=range(pp * tp), world_size=pp * tp, master_addr="127.0.0.1", master_port=free_port(),
                  args=(folder, args.new, pp, tp, args.repeats, str(out)), device="cpu")
            record = json.loads(out.read_text())
        rows[layout] = (torch.tensor(record["tokens"]), record["times"])
        print(f"{layout}: medians {statistics.median(record['times']):.3f} s", flush=True)
    base = statistics.median(times)
    tokens = reference.numel()
    print(f"{Path(folder).name}: {len(PROMPTS)} prompts x {args.new} new tokens, greedy, fp32, CPU, 1 thread per "
          f"rank, median of {args.repeats}")
    print(f"{'layout':<14}{'equal':>7}{'seconds':>10}{'tokens/s':>10}{'vs HF':>8}{'ms/step':>9}")
    figures = {}
    for name, (got, runs) in rows.items():
        seconds = statistics.median(runs)
        equal = torch.equal(got, reference)
        figures[name] = {"equal": equal, "seconds": seconds, "tokens_per_s": tokens / seconds,
                         "ratio_to_transformers": base / seconds, "ms_per_step": 1000 * seconds / steps}
        print(f"{name:<14}{str(equal):>7}{seconds:>10.3f}{tokens / seconds:>10.1f}{base / seconds:>8.2f}"
              f"{1000 * seconds / steps:>9.2f}")
    if "pp1" in figures:
        for name in ("pp2", "pp2xtp2", "pp2xtp3"):
            if name in figures:
                extra = figures[name]["ms_per_step"] - figures["pp1"]["ms_per_step"]
                hops = LAYOUTS[name][0] - 1 + 1  # hidden-state sends + the token broadcast
                print(f"{name}: {extra:+.2f} ms per step over pp1, {extra / hops:+.2f} ms per boundary hop "
                      f"({hops} per step: {LAYOUTS[name][0] - 1} send/recv of [4, 1, hidden] + 1 broadcast)")
    if args.hops:
        import transformers

        hidden = transformers.AutoConfig.from_pretrained(folder).hidden_size
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "hops.json"
            spawn(_hops, ranks=range(2), world_size=2, master_addr="127.0.0.1", master_port=free_port(),
                  args=(hidden, len(PROMPTS), args.hops, str(out)), device="cpu")
            hops = json.loads(out.read_text())
        figures["hops"] = hops
        print(f"one boundary hop alone (send/recv of [{len(PROMPTS)}, 1, {hidden}] fp32, gloo, median of "
              f"{args.hops} round trips / 2): {1000 * hops['hop_s']:.3f} ms; the token broadcast: "
              f"{1000 * hops['broadcast_s']:.3f} ms")
    print(f"load average {os.getloadavg()[0]:.1f} (cores: {os.cpu_count()})")
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""Data loading's share of a training step: the time a rank spends producing its batch (the workload's batch
iterator, `Workload.batches_from`, as the training loop calls it) beside the whole step (that fetch, zero_grad,
`engine.step`, the recipe's optimizer step), measured in one run, step by step.

The job is described by `pipetrain train`'s own flags (parsed and prepared as the CLI does: `describe`, `prepare`)
and runs on 2 spawned CPU ranks (gloo, one thread each): by default `--workload lm --pp 2` on its default preset
(`cpu`) and data (the Gutenberg books), batch 64, 1F1B with 4 micro-batches. `--case jsonl` runs `--workload hf
--model DIR --data FILE.jsonl` instead: a JSON lines corpus (written here from the Gutenberg text, one paragraph a
row) read through Hugging Face `datasets` and the folder's tokenizer (packed windows, `TokenRows.take`).

After `--warmup` steps, `--repeats` rounds of `--steps` steps are timed on rank 0 (the first stage, whose step spans
the whole pipeline); each round's share is its fetch time over its step time. Printed: the median share and its
spread (min-max) over the rounds, the median fetch and step times, and the load average (the CPU is shared).

    python benchmarks/data_share.py [--case lm|jsonl|both] [--model DIR] [--steps 12] [--repeats 3] [-- FLAGS...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from cli_runs import load_average
from pipetrain.cli.main import build_parser
from pipetrain.cli.train_args import describe
from pipetrain.launch.env import free_port
from pipetrain.launch.spawn import RankSpec, spawn
from pipetrain.recipe import Recipe, build_optimizer
from pipetrain.session import close_session, open_session
from pipetrain.train.prepare import prepare

SMOLLM2 = Path.home() / ".cache" / "pipetrain" / "smollm2-135m-instruct"


def _rank(spec: RankSpec, config, data, warmup: int, steps: int, repeats: int, out: Path) -> None:
    """One rank of the job: the loop's fetch and step, timed separately, `warmup + steps * repeats` steps."""
    workload = config.task()
    train, _ = data
    session = open_session(spec, config.model(), config.parallel, seed=config.seed, loss_fn=workload.loss(),
                           precision=config.precision)
    try:
        engine = session.engine
        engine.keep_outputs = False
        total = warmup + steps * repeats
        optimizer = build_optimizer(engine, config.recipe.lr, config.recipe.weight_decay)
        recipe = Recipe(config.recipe, optimizer, engine, total)
        fetch_s, step_s, epoch = [], [], 0
        stream = iter(())
        for step in range(total):
            begin = time.perf_counter()
            batch = next(stream, None)
            if batch is None:  # a new epoch (its first batch's fetch counts, as in the loop)
                epoch += 1
                stream = workload.batches_from(train, config.batch_size, seed=config.seed, epoch=epoch,
                                               replica=session.mesh.dp_rank, replicas=config.parallel.dp,
                                               bucket=config.bucket, start=0)
                batch = next(stream)
            x, y = batch
            fetched = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            result = engine.step(x, y)
            recipe.step(step, result)
            done = time.perf_counter()
            if step >= warmup:
                fetch_s.append(fetched - begin)
                step_s.append(done - begin)
        if spec.rank == 0:
            out.write_text(json.dumps({"fetch_s": fetch_s, "step_s": step_s, "samples": len(train),
                                       "source": train.source}))
    finally:
        close_session()


def measure(flags: list[str], *, warmup: int, steps: int, repeats: int) -> dict:
    """Prepare the job of `pipetrain train FLAGS` (2 ranks) and time it; the per-round figures."""
    args = build_parser(["train"]).parse_args(["train", *flags])
    job = prepare(describe(args), device="cpu")
    world = job.config.parallel.world_size
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        spawn(_rank, ranks=range(world), world_size=world, master_addr="127.0.0.1", master_port=free_port(),
              device="cpu", args=(job.config, job.data, warmup, steps, repeats, out))
        times = json.loads(out.read_text())
    rounds = []
    for r in range(repeats):
        fetch = times["fetch_s"][r * steps:(r + 1) * steps]
        step = times["step_s"][r * steps:(r + 1) * steps]
        rounds.append({"share": sum(fetch) / sum(step), "fetch_ms": 1e3 * statistics.median(fetch),
                       "step_ms": 1e3 * statistics.median(step)})
    return {"rounds": rounds, "source": times["source"], "config": job.config}


def report(name: str, flags: list[str], result: dict, steps: int) -> None:
    shares = [r["share"] for r in result["rounds"]]
    config = result["config"]
    print(f"{name}: pipetrain train {' '.join(flags)}")
    print(f"  data: {result['source']}")
    print(f"  batch {config.batch_size}, pp={config.parallel.pipeline.pp} {config.parallel.pipeline.schedule} x"
          f"{config.parallel.pipeline.n_microbatches}; {len(shares)} rounds of {steps} steps")
    print(f"  batch fetch / whole step: median {100 * statistics.median(shares):.2f} % (rounds: "
          f"{', '.join(f'{100 * s:.2f}' for s in shares)} %; spread {100 * (max(shares) - min(shares)):.2f} points)")
    print(f"  median fetch {statistics.median(r['fetch_ms'] for r in result['rounds']):.2f} ms, median step "
          f"{statistics.median(r['step_ms'] for r in result['rounds']):.1f} ms; load average {load_average()}")


def write_jsonl(path: Path, paragraphs: int) -> None:
    """A JSON lines corpus of `paragraphs` rows `{"text": ...}` from the Gutenberg books (one paragraph a row)."""
    from pipetrain.workloads.text.gutenberg import gutenberg_books

    rows = [text for _, book in gutenberg_books() for text in book.split("\n\n") if len(text.split()) >= 8]
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in rows[:paragraphs]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=("lm", "jsonl", "both"), default="both")
    parser.add_argument("--model", type=Path, default=SMOLLM2, help="the hf model folder for --case jsonl")
    parser.add_argument("--rows", type=int, default=4000, help="rows of the JSON lines corpus (default: 4000)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12, help="steps per timed round (default: 12)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (default: 3)")
    parser.add_argument("flags", nargs="*", help="more `pipetrain train` flags (after --)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    common = ["--pp", "2", "--no-progress", *args.flags]
    kwargs = {"warmup": args.warmup, "steps": args.steps, "repeats": args.repeats}
    if args.case in ("lm", "both"):
        flags = ["--workload", "lm", *common]
        report("lm (default preset and data)", flags, measure(flags, **kwargs), args.steps)
    if args.case in ("jsonl", "both"):
        if not args.model.is_dir():
            sys.exit(f"--case jsonl needs a model folder: {args.model} is not one (run `make test` or pass --model)")
        with tempfile.TemporaryDirectory() as tmp:
            data = Path(tmp) / "corpus.jsonl"
            write_jsonl(data, args.rows)
            flags = ["--workload", "hf", "--model", str(args.model), "--data", str(data), "--batch-size", "8",
                     "--seq-len", "128", *common]
            report("hf, JSON lines", flags, measure(flags, **kwargs), args.steps)


if __name__ == "__main__":
    main()

"""Benchmark: how long a checkpoint blocks training, synchronous save against `--async-save`, side by side.

For each layout (pp=2 on 2 ranks; dp=2 x pp=2 DDP on 4 ranks), one spawned job trains the `--preset` classifier
(AdamW, synthetic batches of 64) and, in each of `--rounds` rounds, saves once in the background
(`BackgroundSaver`, what `--async-save` uses), trains `--every` steps, waits for that save to commit, then saves
once synchronously (`save_checkpoint`) and trains `--every` steps. Blocked time: the synchronous save's
duration; for the background save, its call (the state copied to CPU memory) plus the wait after the steps
(zero when the write finished meanwhile). It also prints the step time while a background write is in flight
against the step time after a synchronous save (on a 2-core machine the writer competes with the ranks), and
the net cost of a background save: its blocked time plus what the steps after it took longer, against the
synchronous save.
Medians on rank 0. Run: `.venv/bin/python benchmarks/async_save.py [--preset cpu] [--rounds 5] [--every 4]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pipetrain.checkpoint import save_checkpoint
from pipetrain.checkpoint.background import BackgroundSaver
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.launch.env import free_port
from pipetrain.launch.spawn import RankSpec, spawn
from pipetrain.session import build_session, close_session, join_job
from pipetrain.workloads.classifier.model import PRESETS, TransformerClassifier

PIPELINE = PipelineConfig(pp=2, schedule="1f1b", n_microbatches=4)
LAYOUTS = {"pp2": (2, ParallelConfig(pipeline=PIPELINE)), "dp2xpp2": (4, ParallelConfig(dp=2, pipeline=PIPELINE))}
BATCH = 64


def _job(spec: RankSpec, preset: str, parallel: ParallelConfig, rounds: int, every: int, folder: str) -> None:
    device = join_job(spec)
    try:
        config = PRESETS[preset]
        engine = build_session(TransformerClassifier(config), parallel, device, seed=0).engine
        optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-4)
        gen = torch.Generator().manual_seed(0)
        share = BATCH // parallel.dp
        x = torch.randint(0, config.vocab_size, (share, config.seq_len), generator=gen)
        y = torch.randint(0, 2, (share,), generator=gen)

        def steps(count: int) -> list[float]:
            times = []
            for _ in range(count):
                start = time.perf_counter()
                optimizer.zero_grad()
                engine.step(x, y)
                optimizer.step()
                times.append(time.perf_counter() - start)
            return times

        saver = BackgroundSaver()
        steps(2)
        sync_s, async_s, waited_s, in_flight_steps, quiet_steps = [], [], [], [], []
        for index in range(rounds):
            start = time.perf_counter()
            saver.save(Path(folder), engine, optimizer, step=2 * index + 1, model_name="bench", config=None,
                       extras=None, keep=2)
            called = time.perf_counter() - start
            in_flight_steps += steps(every)
            start = time.perf_counter()
            saver.wait()
            waited_s.append(time.perf_counter() - start)
            async_s.append(called + waited_s[-1])
            start = time.perf_counter()
            save_checkpoint(folder, engine, optimizer, step=2 * index + 2, keep=2)
            sync_s.append(time.perf_counter() - start)
            quiet_steps += steps(every)
        if spec.rank == 0:
            Path(folder, "result.json").write_text(json.dumps({
                "sync_s": statistics.median(sync_s), "async_s": statistics.median(async_s), "waited_s": statistics.median(waited_s),
                "in_flight_step_s": statistics.median(in_flight_steps), "step_s": statistics.median(quiet_steps),
            "slower_s": (sum(in_flight_steps) - sum(quiet_steps)) / rounds}))
    finally:
        close_session()


def measure(preset: str, layout: str, rounds: int, every: int) -> dict:
    world, parallel = LAYOUTS[layout]
    with tempfile.TemporaryDirectory() as folder:
        spawn(_job, ranks=range(world), world_size=world, master_addr="127.0.0.1", master_port=free_port(),
              args=(preset, parallel, rounds, every, folder), timeout_s=1800)
        return json.loads(Path(folder, "result.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--every", type=int, default=4, help="training steps after each save")
    args = parser.parse_args()
    print(f"preset {args.preset}, {args.rounds} rounds, {args.every} steps after each save (medians, rank 0)")
    print("| layout | sync save s | async blocked s (waiting) | blocked / sync | step s | step s, write in flight "
          "| ratio | net async / sync |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for layout in LAYOUTS:
        r = measure(args.preset, layout, args.rounds, args.every)
        print(f"| {layout} | {r['sync_s']:.3f} | {r['async_s']:.3f} ({r['waited_s']:.3f}) | {r['async_s'] / r['sync_s']:.2f} | "
              f"{r['step_s']:.3f} | {r['in_flight_step_s']:.3f} | {r['in_flight_step_s'] / r['step_s']:.2f} | "
              f"{(r['async_s'] + r['slower_s']) / r['sync_s']:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()

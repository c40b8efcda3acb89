"""Benchmark: the cost of a checkpoint — seconds per save and bytes written — against training time and model size.

For each layout (pp=2 on 2 ranks; dp=2 x pp=2 FSDP on 4 ranks) and each preset (`tiny`, `cpu`), one spawned
job builds the reference Transformer classifier, trains `--steps` AdamW steps on synthetic batches of 64
(after 2 warm-up steps), then saves `--saves` checkpoints with `pipetrain.checkpoint.save_checkpoint` (DCP,
every rank writing its own shards, then the atomic commit). Step and save times are medians on rank 0 (both end
in a collective, so they are the job's); bytes are those of the last checkpoint folder on disk.

The overhead of saving every N steps is save_s / (N * step_s); the script prints, for each row, the smallest
N that keeps it under 5 %, and the overhead at `--every` (the README's suggested N).
Run: `.venv/bin/python benchmarks/checkpoint_cost.py [--steps 10] [--saves 3] [--every 200]`.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pipetrain.checkpoint import save_checkpoint
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.launch.env import free_port
from pipetrain.launch.spawn import RankSpec, spawn
from pipetrain.session import build_session, close_session, join_job
from pipetrain.workloads.classifier.model import PRESETS, TransformerClassifier

LAYOUTS = {
    "pp2": (2, ParallelConfig(pipeline=PipelineConfig(pp=2, schedule="1f1b", n_microbatches=4))),
    "dp2xpp2-fsdp": (4, ParallelConfig(dp=2, dp_mode="fsdp", pipeline=PipelineConfig(pp=2, schedule="1f1b",
                                                                                    n_microbatches=4))),
}
BATCH = 64


def _job(spec: RankSpec, preset: str, parallel: ParallelConfig, steps: int, saves: int, folder: str) -> None:
    device = join_job(spec)
    try:
        config = PRESETS[preset]
        session = build_session(TransformerClassifier(config), parallel, device, seed=0)
        engine, mesh = session.engine, session.mesh
        optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-4)
        gen = torch.Generator().manual_seed(0)
        share = BATCH // parallel.dp
        x = torch.randint(0, config.vocab_size, (BATCH, config.seq_len), generator=gen)[mesh.dp_rank * share:][:share]
        y = torch.randint(0, 2, (BATCH,), generator=gen)[mesh.dp_rank * share:][:share]
        step_times, save_times = [], []
        for index in range(2 + steps):
            start = time.perf_counter()
            optimizer.zero_grad()
            engine.step(x, y)
            optimizer.step()
            if index >= 2:
                step_times.append(time.perf_counter() - start)
        for index in range(saves):
            start = time.perf_counter()
            last = save_checkpoint(folder, engine, optimizer, step=index + 1, keep=1)
            save_times.append(time.perf_counter() - start)
        if spec.rank == 0:
            written = sum(f.stat().st_size for f in last.iterdir())
            model = TransformerClassifier(config)
            params = sum(p.numel() * p.element_size() for i in range(model.num_blocks)
                         for p in model.build_block(i).parameters())
            Path(folder, "result.json").write_text(json.dumps({
                "step_s": statistics.median(step_times), "save_s": statistics.median(save_times),
                "bytes": written, "param_bytes": params}))
    finally:
        close_session()


def measure(preset: str, layout: str, steps: int, saves: int) -> dict:
    world, parallel = LAYOUTS[layout]
    with tempfile.TemporaryDirectory() as folder:
        spawn(_job, ranks=range(world), world_size=world, master_addr="127.0.0.1", master_port=free_port(),
              args=(preset, parallel, steps, saves, folder), timeout_s=1800)
        return json.loads(Path(folder, "result.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--every", type=int, default=200, help="the suggested N of the README")
    parser.add_argument("--presets", default="tiny,cpu")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    args = parser.parse_args()
    print("| preset | layout | parameters | bytes per save | bytes / parameter bytes | step (s) | save (s) | "
          f"save / step | N for < 5 % | overhead at N={args.every} |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for preset in args.presets.split(","):
        for layout in args.layouts.split(","):
            r = measure(preset, layout, args.steps, args.saves)
            ratio = r["save_s"] / r["step_s"]
            print(f"| {preset} | {layout} | {r['param_bytes'] / 1e6:.2f} MB | {r['bytes'] / 1e6:.2f} MB | "
                  f"{r['bytes'] / r['param_bytes']:.2f} | {r['step_s']:.3f} | {r['save_s']:.3f} | {ratio:.1f} | "
                  f"{math.ceil(ratio / 0.05)} | {100 * ratio / args.every:.2f} % |", flush=True)
    print("(machine shared: timings are noisy; bytes are exact)")


if __name__ == "__main__":
    main()

"""Benchmark: balancing stages by measured time (`--partition time`) on a deliberately unbalanced model.

The model (`UnevenMLP`) is 12 residual MLP blocks of width `--width`: 6 light blocks (hidden = width)
then 6 heavy ones (hidden = `--heavy` x width), so a uniform split at pp=2 puts every heavy block on
the last stage. The blocks are profiled in this process (one thread, as a rank
runs) and `pipetrain.partition.cost_balance` picks the split minimising the slowest stage's
forward+backward time. One spawned job (`--pp` ranks, gloo, one thread each) then times, in interleaved
rounds (see `interleave.py`): the uniform split, the time-balanced split and, at pp=2, every contiguous
split, each as a 1F1B pipeline with `--chunks` micro-batches. Times are rank 0's wall-clock step times;
the busiest rank's CPU time per step is shown beside them: on an oversubscribed machine the ranks stop
running in parallel and wall times converge, while CPU time still shows the slowest stage's work.

Targets: the time-balanced split within 5% of the fastest split measured (pp=2), and at least 1.3x
faster than uniform. Run: `.venv/bin/python benchmarks/balance.py [--quick] [--pp 4] [--json PATH]`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn

from interleave import cpu_per_rank, finish, markdown_table, median_s, paired_ratio, resolve_defaults, run_job
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.launch.ranks import RankSpec
from pipetrain.partition import cost_balance, uniform_balance
from pipetrain.partition.measure import profile_model
from pipetrain.partition.stagecost import stage_costs
from pipetrain.session import build_session

FULL = {"rounds": 5, "steps": 3, "warmup": 2}
QUICK = {"rounds": 2, "steps": 2, "warmup": 1}
NEAR_BEST = 1.05
OVER_UNIFORM = 1.3
LIGHT_BLOCKS, HEAVY_BLOCKS = 6, 6


class ResidualMLP(nn.Module):
    """x + W2 gelu(W1 norm(x)): one block of `UnevenMLP`."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class UnevenMLP:
    """A `BlockModel` of light blocks then heavy blocks (hidden `heavy` x width); classifies into `width` classes."""

    def __init__(self, width: int, heavy: int) -> None:
        self.width, self.heavy = width, heavy

    @property
    def num_blocks(self) -> int:
        return LIGHT_BLOCKS + HEAVY_BLOCKS

    def build_block(self, index: int) -> nn.Module:
        hidden = self.width * (self.heavy if index >= LIGHT_BLOCKS else 1)
        return ResidualMLP(self.width, hidden)

    def example_input(self, batch_size: int) -> torch.Tensor:
        return torch.zeros(batch_size, self.width)


def _model(args: argparse.Namespace) -> UnevenMLP:
    return UnevenMLP(args.width, args.heavy)


def _pipeline(args: argparse.Namespace, balance: list[int] | tuple[int, ...]) -> ParallelConfig:
    return ParallelConfig(pipeline=PipelineConfig(pp=args.pp, schedule="1f1b", n_microbatches=args.chunks,
                                                  balance=tuple(balance)))


def measure(spec: RankSpec, device: torch.device, args: argparse.Namespace) -> dict:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch_size, args.width, generator=gen)
    y = torch.randint(0, args.width, (args.batch_size,), generator=gen)
    steps = {}
    for name, balance in args.configs.items():
        engine = build_session(_model(args), _pipeline(args, balance), device, seed=0).engine
        optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-4)

        def step(engine=engine, optimizer=optimizer) -> float:
            optimizer.zero_grad(set_to_none=True)
            loss = engine.step(x, y).loss
            optimizer.step()
            return loss

        steps[name] = step
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2, help="pipeline ranks (default: 2; every split is timed at 2)")
    parser.add_argument("--width", type=int, default=256, help="block width (default: 256)")
    parser.add_argument("--heavy", type=int, default=6, help="hidden size of a heavy block / width (default: 6)")
    parser.add_argument("--batch-size", type=int, default=128, help="global batch size (default: 128)")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches (default: 4)")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also save the raw times as JSON")
    args = parser.parse_args()
    resolve_defaults(args, full=FULL, quick=QUICK)

    model = _model(args)
    uniform = uniform_balance(model.num_blocks, args.pp)
    micro = args.batch_size // args.chunks
    pipeline = PipelineConfig(pp=args.pp, schedule="1f1b", n_microbatches=args.chunks, partition="time")
    torch.set_num_threads(1)  # as each rank runs
    profile = profile_model(model, micro, repeats=5)
    _, choice = cost_balance(model, pipeline, micro_batch_size=micro, profile=profile)
    configs = {"uniform": uniform, "time": list(choice.balance)}
    if args.pp == 2:
        for cut in range(1, model.num_blocks):
            configs[f"split {cut},{model.num_blocks - cut}"] = [cut, model.num_blocks - cut]
    args.configs = configs
    print("\n".join(choice.lines()))
    report = run_job(measure, args, world_size=args.pp)
    times = report["ranks"][0]["wall_s"]

    rows = []  # the predicted slowest stage comes from the profile the balance was chosen with
    for name, balance in configs.items():
        predicted = max(s.time_s for s in stage_costs(profile, balance, schedule="1f1b", chunks=args.chunks))
        busiest = max(cpu_per_rank(report, name))
        rows.append([name, ",".join(map(str, balance)), f"{predicted * 1e3:.2f}", f"{median_s(times[name]) * 1e3:.1f}",
                     f"{paired_ratio(times['uniform'], times[name]):.2f}x", f"{busiest * 1e3:.1f}",
                     f"{max(cpu_per_rank(report, 'uniform')) / busiest:.2f}x"])
    text = [f"UnevenMLP width {args.width}, {LIGHT_BLOCKS} light + {HEAVY_BLOCKS} heavy (x{args.heavy}) blocks, "
            f"pp={args.pp}, 1f1b, batch {args.batch_size}, chunks {args.chunks}",
            "", markdown_table(["config", "balance", "predicted slowest stage (ms/micro-batch)",
                                "median step (ms)", "speed-up vs uniform", "busiest rank CPU/step (ms)",
                                "CPU bottleneck vs uniform"], rows), ""]
    over_uniform = paired_ratio(times["uniform"], times["time"])
    text.append(f"time-balanced vs uniform: {over_uniform:.2f}x faster (target >= {OVER_UNIFORM}x)")
    if args.pp == 2:
        splits = [n for n in configs if n.startswith("split")]
        best = min(splits, key=lambda n: median_s(times[n]))
        gap = paired_ratio(times["time"], times[best])
        text.append(f"fastest measured split: {best} ({median_s(times[best]) * 1e3:.1f} ms); time-balanced is "
                    f"{100 * (gap - 1):+.1f}% from it (target within {100 * (NEAR_BEST - 1):.0f}%)")
    busiest = {name: max(cpu_per_rank(report, name)) for name in configs}
    text.append(f"by the busiest rank's CPU time per step: time-balanced {busiest['uniform'] / busiest['time']:.2f}x "
                "lighter than uniform" + (f", {100 * (busiest['time'] / min(busiest[n] for n in configs if n.startswith('split')) - 1):+.1f}% "
                                          "from the lightest split" if args.pp == 2 else ""))
    finish(report, "\n".join(text), args.json)


if __name__ == "__main__":
    main()

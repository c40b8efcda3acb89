"""The reward curve of a GRPO run as a PNG, from its `steps.jsonl`: each step's mean rollout reward (sampled
completions, training prompts), its running mean, and the held-out evaluations' reward (greedy completions of
held-out prompts) where the run made them.

    python benchmarks/grpo_curve.py RUN_DIR/steps.jsonl [MORE/steps.jsonl ...] --out docs/alignment/grpo-reward.png

Several files (the run dirs of a job and its resumed parts) are read in order, a later record of a step replacing
an earlier one.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from pipetrain.logs.jsonl import read_records


def running_mean(values: list[float], width: int) -> list[float]:
    """The mean of each value and the `width - 1` before it (fewer at the start)."""
    return [sum(values[max(0, i + 1 - width): i + 1]) / (i + 1 - max(0, i + 1 - width)) for i in range(len(values))]


def _records(files: list[Path], kind: str) -> list[dict]:
    """The `kind` records of `files`, one per step (the last file's), by step."""
    by_step = {r["step"]: r for f in files for r in read_records(f, kind)}
    return [by_step[k] for k in sorted(by_step)]


def draw(files: list[Path], out: Path, title: str, width: int = 5) -> None:
    steps = _records(files, "step")
    held = [e for e in _records(files, "eval") if e.get("reward") is not None]
    x, reward = [r["step"] for r in steps], [r["reward"] for r in steps]
    figure = Figure(figsize=(7, 4), dpi=110)
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    ax.plot(x, reward, "o", color="tab:blue", alpha=0.35, markersize=4, label="rollout reward (sampled, per step)")
    ax.plot(x, running_mean(reward, width), color="tab:blue", label=f"running mean of {width} steps")
    functions = sorted(k for k in steps[0] if k.startswith("rewards/"))  # rewards/<function>/mean
    for name, style in zip(functions if len(functions) > 1 else [], ("--", ":", "-.")):  # each reward's share
        ax.plot(x, running_mean([r[name] for r in steps], width), style, color="tab:blue", linewidth=1,
                label=f"{name} (running mean)")
    if held:
        ax.plot([e["step"] for e in held], [e["reward"] for e in held], "s-", color="tab:orange",
                label="held-out reward (greedy)")
        for name in functions if len(functions) > 1 else []:
            ax.plot([e["step"] for e in held], [e[name] for e in held], "s--", color="tab:orange", linewidth=1,
                    markersize=3, label=f"held-out {name}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.02, max(1.02, max(reward) * 1.05))
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out)
    print(f"wrote {out} ({len(steps)} steps, {len(held)} held-out evaluations)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("steps", type=Path, nargs="+", help="a run's steps.jsonl (and its resumed parts')")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    parser.add_argument("--title", default="GRPO reward")
    args = parser.parse_args()
    draw(args.steps, args.out, args.title)


if __name__ == "__main__":
    main()

"""SmolLM2-135M fine-tuning: the unsplit transformers model in one process vs pipetrain at pp=2, pp=4 (1F1B) and dp2 x pp2.

Every layout runs in its own spawned job, one after the other (never two 135M jobs at once), on the same global
batch of Gutenberg text (`--batch-size` windows of `--seq-len` tokens of the model's own tokenizer): one untimed
AdamW step, then `--steps` timed ones. Printed per layout: the first step's loss and its difference to the
unsplit model's, the median step time, tokens/s, and each rank's peak resident memory (`ru_maxrss`, torch and
transformers included: compare with the unsplit process's), each as a ratio to the unsplit model.

    python benchmarks/smollm2.py [--steps 3] [--batch-size 8] [--seq-len 64] [--json out.json]
    python benchmarks/smollm2.py heldout DIR --data FILE [--seq-len 64]   # held-out loss of a HF folder, unsplit
    python benchmarks/smollm2.py generate DIR                             # greedy continuation of the prompt
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.launch.env import free_port
from pipetrain.launch.spawn import RankSpec, spawn
from pipetrain.session import build_session, close_session, join_job
from pipetrain.workloads.text.gutenberg import gutenberg_folder
from pipetrain.workloads.hf.causal_lm import HFCausalLM, causal_lm_loss
from pipetrain.workloads.hf.smollm2 import prepare

PROMPT = "The capital of France is"
#: name -> (dp, pp); (1, 1) is the unsplit transformers model
LAYOUTS = {"unsplit": (1, 1), "pp2": (1, 2), "pp4": (1, 4), "dp2xpp2": (2, 2)}


def _batch(folder: Path, batch_size: int, seq_len: int) -> torch.Tensor:
    import transformers

    text = (gutenberg_folder() / "austen-emma.txt").read_text()[: 200 * batch_size * seq_len]
    ids = transformers.AutoTokenizer.from_pretrained(folder)(text, add_special_tokens=False)["input_ids"]
    return torch.tensor(ids[: batch_size * seq_len]).view(batch_size, seq_len)


def _worker(spec: RankSpec, layout: str, folder: str, ids: torch.Tensor, steps: int, out: str) -> None:
    dp, pp = LAYOUTS[layout]
    torch.set_num_threads(1)
    times, losses = [], []
    if layout == "unsplit":
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(folder)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
        for _ in range(steps + 1):
            start = time.perf_counter()
            opt.zero_grad()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
    else:
        device = join_job(spec)
        try:
            model = HFCausalLM.from_folder(folder, seq_len=ids.shape[1])
            parallel = ParallelConfig(dp=dp, pipeline=PipelineConfig(pp=pp, schedule="1f1b", n_microbatches=max(pp, 2)))
            session = build_session(model, parallel, device, loss_fn=causal_lm_loss)
            opt = torch.optim.AdamW(session.engine.parameters(), lr=1e-4, weight_decay=0.0)
            share = ids.shape[0] // dp
            mine = ids[session.mesh.dp_rank * share : (session.mesh.dp_rank + 1) * share]
            for _ in range(steps + 1):
                start = time.perf_counter()
                opt.zero_grad()
                losses.append(session.engine.step(mine, mine).loss)
                opt.step()
                times.append(time.perf_counter() - start)
        finally:
            close_session()
    record = {"times": times[1:], "losses": losses, "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    Path(out, f"{layout}-rank{spec.rank}.json").write_text(json.dumps(record))


def speed(args: argparse.Namespace) -> None:
    folder = prepare()
    ids = _batch(folder, args.batch_size, args.seq_len)
    tokens = ids.numel()
    rows = {}
    with tempfile.TemporaryDirectory() as out:
        for layout, (dp, pp) in LAYOUTS.items():
            world = dp * pp
            spawn(_worker, ranks=range(world), world_size=world, master_addr="127.0.0.1", master_port=free_port(),
                  args=(layout, str(folder), ids, args.steps, out), timeout_s=1800)
            ranks = [json.loads(Path(out, f"{layout}-rank{r}.json").read_text()) for r in range(world)]
            step = statistics.median(max(r["times"][i] for r in ranks) for i in range(args.steps))
            rows[layout] = {"first_loss": ranks[0]["losses"][0], "step_s": step, "tokens_per_s": tokens / step,
                            "maxrss_mb": [r["maxrss_mb"] for r in ranks], "losses": ranks[0]["losses"]}
    base = rows["unsplit"]
    print(f"SmolLM2-135M, global batch {args.batch_size} x {args.seq_len} tokens, AdamW, {args.steps} timed steps, "
          f"1 thread per rank")
    print(f"{'layout':9} {'first loss':>10} {'vs unsplit':>10} {'step s':>7} {'tokens/s':>9} {'x unsplit':>9}  "
          "peak RSS per rank, MB (x unsplit)")
    for layout, row in rows.items():
        memory = ", ".join(f"{m:.0f} ({m / base['maxrss_mb'][0]:.2f})" for m in row["maxrss_mb"])
        print(f"{layout:9} {row['first_loss']:10.5f} {row['first_loss'] - base['first_loss']:10.1e} "
              f"{row['step_s']:7.2f} {row['tokens_per_s']:9.0f} {row['tokens_per_s'] / base['tokens_per_s']:9.2f}  {memory}")
    print(f"machine load (1/5/15 min): {' '.join(f'{x:.1f}' for x in __import__('os').getloadavg())}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def heldout(args: argparse.Namespace) -> None:
    """The held-out loss of a HF folder on the held-out split a `train --model` job of this data evaluates."""
    import transformers

    from pipetrain.train.loop import TrainConfig, load_data

    config = TrainConfig(workload="hf", model_dir=args.model, data=args.data, seq_len=args.seq_len)
    _, test = load_data(config)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.folder).eval()
    total = count = 0.0
    with torch.no_grad():
        for x, y in config.task().batches(test, 8, shuffle=False, seed=0, epoch=0, replica=0, replicas=1):
            logits = model(input_ids=x).logits
            total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
            count += int((y != -100).sum())
    print(f"{args.folder}: held-out loss {total / count:.4f} (ppl {torch.tensor(total / count).exp():.2f}) "
          f"over {int(count)} tokens of {test.source}")


def generate(args: argparse.Namespace) -> None:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.folder).eval()
    ids = tokenizer(PROMPT, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    print(repr(tokenizer.decode(out[0], skip_special_tokens=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None)
    verbs = parser.add_subparsers(dest="verb")
    held = verbs.add_parser("heldout")
    held.add_argument("folder", type=Path)
    held.add_argument("--model", type=Path, required=True, help="the folder whose tokenizer cut the data")
    held.add_argument("--data", type=Path, required=True)
    held.add_argument("--seq-len", type=int, default=64)
    gen = verbs.add_parser("generate")
    gen.add_argument("folder", type=Path)
    args = parser.parse_args()
    {"heldout": heldout, "generate": generate}.get(args.verb, speed)(args)


if __name__ == "__main__":
    main()

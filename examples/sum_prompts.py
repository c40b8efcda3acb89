"""Two-digit additions for GRPO: prompt rows (a chat question, the `answer` the reward reads) to train on with
`--objective grpo --reward examples/sum_reward.py:exact`, and the same questions as chat rows with their answer,
for `pipetrain eval`'s greedy exact-match accuracy on the held-out split (every 10th row: the same questions in
both files).

    python examples/sum_prompts.py OUT_DIR [--rows 400] [--seed 0] [--low 10 --high 99]

Operands are drawn from `--low`..`--high`; when `--rows` covers every pair of them (one-digit sums: `--low 0 --high 9
--rows 100`), each pair is asked once, shuffled, so no held-out question is trained on.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

QUESTION = "What is {a} + {b}? Answer with the number only."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--rows", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--low", type=int, default=10, help="smallest operand")
    parser.add_argument("--high", type=int, default=99, help="largest operand")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    every = [(a, b) for a in range(args.low, args.high + 1) for b in range(args.low, args.high + 1)]
    if args.rows >= len(every):  # each pair once
        sums = rng.sample(every, len(every))
    else:
        sums = [(rng.randint(args.low, args.high), rng.randint(args.low, args.high)) for _ in range(args.rows)]
    args.out.mkdir(parents=True, exist_ok=True)
    prompts, chats = [], []
    for a, b in sums:
        user = [{"role": "user", "content": QUESTION.format(a=a, b=b)}]
        prompts.append(json.dumps({"prompt": user, "answer": str(a + b)}) + "\n")
        chats.append(json.dumps({"messages": user + [{"role": "assistant", "content": str(a + b)}]}) + "\n")
    (args.out / "sums.jsonl").write_text("".join(prompts))
    (args.out / "sums_chat.jsonl").write_text("".join(chats))
    print(f"{len(sums)} additions in {args.out}: sums.jsonl (GRPO prompts), sums_chat.jsonl (eval rows)")


if __name__ == "__main__":
    main()

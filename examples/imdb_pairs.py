"""Preference pairs from the IMDB reviews (the classifier's data): a short review, the question "positive or
negative?", the true sentiment as the chosen answer and the other as the rejected one, as chat rows in TRL's
preference format; held-out prompt/answer rows of other reviews for `pipetrain eval`'s answer accuracy. The
reviews are shuffled (`--seed`): the package's come sorted by sentiment. With `--train N`, also
`train_pairs.jsonl`: N pairs of pairs.jsonl outside its held-out split (every 10th pair), to train on while
`pipetrain eval --data pairs.jsonl` measures pairs that never trained.

    python examples/imdb_pairs.py OUT_DIR [--pairs 480] [--answers 100] [--train 150] [--seed 0]
    pipetrain train --workload hf --model ~/.cache/pipetrain/smollm2-135m-instruct --data OUT_DIR/pairs.jsonl \
        --objective dpo --lora-rank 8 --pp 2 --chunks 2 --batch-size 8 --seq-len 192 --max-steps 40
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from pipetrain.workloads.classifier.imdb_package import IMDB_SOURCE, package_csv, read_reviews
from pipetrain.workloads.lm.corpus import HOLD_OUT_EVERY

QUESTION = "Is this movie review positive or negative? Answer with one word.\n\nReview: {review}"
LABELS = ("negative", "positive")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--pairs", type=int, default=480)
    parser.add_argument("--answers", type=int, default=100)
    parser.add_argument("--chars", type=int, default=400, help="reviews up to this many characters")
    parser.add_argument("--train", type=int, default=0, help="pairs outside the held-out split to train on")
    parser.add_argument("--seed", type=int, default=0, help="the shuffle of the reviews")
    args = parser.parse_args()
    texts, labels = read_reviews(package_csv(), IMDB_SOURCE)
    short = [(t.replace("<br />", " "), y) for t, y in zip(texts, labels) if len(t) <= args.chars]
    random.Random(args.seed).shuffle(short)  # the package's reviews come sorted by sentiment: mix them
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [json.dumps({"prompt": [{"role": "user", "content": QUESTION.format(review=text)}],
                        "chosen": [{"role": "assistant", "content": LABELS[label]}],
                        "rejected": [{"role": "assistant", "content": LABELS[1 - label]}]}) + "\n"
            for text, label in short[: args.pairs]]
    (args.out / "pairs.jsonl").write_text("".join(rows))
    if args.train:  # (pairs.jsonl's held-out split: every HOLD_OUT_EVERY-th pair, none dropped as too long)
        train = [row for i, row in enumerate(rows) if i % HOLD_OUT_EVERY != HOLD_OUT_EVERY - 1][: args.train]
        (args.out / "train_pairs.jsonl").write_text("".join(train))
    with open(args.out / "answers.jsonl", "w") as f:
        for text, label in short[args.pairs: args.pairs + args.answers]:
            f.write(json.dumps({"messages": [{"role": "user", "content": QUESTION.format(review=text)},
                                             {"role": "assistant", "content": LABELS[label]}]}) + "\n")
    chosen, answers = sum(y for _, y in short[: args.pairs]), len(short[args.pairs: args.pairs + args.answers])
    print(f"{min(args.pairs, len(short))} pairs ({chosen} positive), {answers} answer rows in {args.out}")


if __name__ == "__main__":
    main()

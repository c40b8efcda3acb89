"""The cost of finding the assistant turns of chat rows, side by side in one process: rows per second of
`tokenize_rows` on multi-turn chat rows (one render per assistant turn with a sentinel, plus the rendering of each
turn as the last), against the floor of rendering each conversation once and tokenizing it (what any chat row
costs), and against the template's own `{% generation %}` mask where the template has the marks (the same ChatML
template with them added). What the tokenization cache pays once per data set and tokenizer.

    python benchmarks/chat_spans.py [--model DIR] [--rows 400] [--turns 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from pipetrain.data.render import tokenize_rows
from pipetrain.workloads.hf.text import load_tokenizer

GENERATION = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "chat_templates" / "chatml_generation.jinja"


def rows(count: int, turns: int) -> list[list[dict]]:
    out = []
    for i in range(count):
        row = [{"role": "system", "content": "You are a helpful assistant."}]
        for t in range(turns):
            row += [{"role": "user", "content": f"Question {i}.{t}: is review {i * 7 + t} good? " * 3},
                    {"role": "assistant", "content": f"It is {'good' if (i + t) % 2 else 'bad'}, because " * 4}]
        out.append(row)
    return out


def rate(run, count: int, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return count / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path.home() / ".cache" / "pipetrain" / "smollm2-135m-instruct")
    parser.add_argument("--rows", type=int, default=400)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.model)
    data = rows(args.rows, args.turns)
    batch, indices = {"messages": data}, list(range(len(data)))

    def spans():
        tokenize_rows(batch, indices, tokenizer=tokenizer, kind="chat", fields=("messages",), source="bench")

    def floor():
        for row in data:
            tokenizer(tokenizer.apply_chat_template(row, tokenize=False), add_special_tokens=False,
                      return_offsets_mapping=True)

    found, once = rate(spans, len(data), args.rounds), rate(floor, len(data), args.rounds)
    tokenizer.chat_template = GENERATION.read_text()
    marked = rate(spans, len(data), args.rounds)
    print(f"{args.model.name}, {len(data)} rows of {args.turns} user/assistant turns (+ a system message), medians of "
          f"{args.rounds} rounds, one process:")
    print(f"  render once + tokenize (the floor):      {once:8.0f} rows/s")
    print(f"  assistant turns by sentinel (any template): {found:8.0f} rows/s  ({once / found:.1f}x the floor's time)")
    print(f"  the template's {{% generation %}} mask:     {marked:8.0f} rows/s  ({once / marked:.1f}x the floor's time)")


if __name__ == "__main__":
    main()

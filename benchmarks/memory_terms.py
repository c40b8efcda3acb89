"""Benchmark: the planner's per-tensor memory terms, measured on the CPU in one process.

1. The loss: what `F.cross_entropy` (fp32 logits of `--tokens` x `--vocab`) allocates, counted by a dispatch mode
   that follows each storage an operator creates until it is freed (a weak reference to the storage: it lives as
   long as autograd or anything else holds it). Printed in logits-sized units: the forward's peak and what it
   leaves held (the saved log-softmax), the backward's peak and what it leaves (the logits' gradient), beside the
   planner's `1 + BACKWARD_TEMPORARIES` (plan/loss.py).
2. An eager Hugging Face Llama layer (`llama-cpu`, fp32, `--batch` x 128 tokens): the bytes its saved-tensor hooks
   see (each storage once; parameters and their transposed views left out), beside `layer_activation_bytes`
   (plan/transformer.py), and each saved tensor with the backward node that saved it (`--verbose`).
3. The engine's last stage: one training step of the `lm` preset at a large vocabulary (`--lm-vocab`), pp 1, 4
   micro-batches of 4 x 128 tokens, in a world of one gloo rank, under each of `--lm-schedules` (1F1B: one
   micro-batch in flight; GPipe: all 4), in `--lm-precision` (fp32; bf16: autocast): the peak of the bytes the
   step allocates (the same dispatch mode) and its loss and accuracy, with the engine's outputs dropped (as
   `pipetrain train` runs it) and kept (as a caller reading `StepResult.outputs` does).

Run: `.venv/bin/python benchmarks/memory_terms.py [--vocab 1000] [--tokens 4096] [--batch 4] [--lm-vocab 32768]
[--lm-schedules 1f1b,gpipe] [--lm-precision fp32]`.
"""

from __future__ import annotations

import argparse
import gc

import torch
import torch.nn.functional as F

from pipetrain.compat.live import LiveBytes
from pipetrain.plan.loss import BACKWARD_TEMPORARIES
from pipetrain.plan.transformer import sizes_from_config

MB = 2**20


def loss_terms(tokens: int, vocab: int) -> dict[str, float]:
    """`F.cross_entropy`'s forward and backward, in logits-sized units (see the module docstring)."""
    logits = torch.randn(tokens, vocab, requires_grad=True)
    target = torch.randint(0, vocab, (tokens,))
    unit = float(tokens * vocab * 4)
    with LiveBytes() as live:
        loss = F.cross_entropy(logits, target, reduction="sum")
        gc.collect()
        out = {"forward peak": live.peak / unit, "held for backward": live.bytes / unit}
        live.reset()
        loss.backward()
        gc.collect()
        out.update({"backward peak": live.peak / unit, "left after backward": live.bytes / unit,
                    "planned backward peak": 1.0 + BACKWARD_TEMPORARIES})
    return out


def layer_terms(batch: int, verbose: bool = False) -> dict[str, float]:
    """An eager `llama-cpu` decoder layer's saved tensors (MB per micro-batch), beside the planner's count."""
    from pipetrain.workloads.hf.causal_lm import HFCausalLM
    from pipetrain.workloads.hf.workload import HF_PRESETS

    config, seq = HF_PRESETS["llama-cpu"].config(), 128
    model = HFCausalLM(config, seq_len=seq)
    embed, layer = model.build_block(0), model.build_block(1)
    hidden = embed(torch.randint(0, config.vocab_size, (batch, seq)))
    inputs = tuple(t.detach().requires_grad_(t.is_floating_point())
                   for t in (hidden if isinstance(hidden, tuple) else (hidden,)))
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    seen: dict[int, tuple[int, tuple[int, ...]]] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen.setdefault(storage.data_ptr(), (storage.nbytes(), tuple(tensor.shape)))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(*inputs)
    if verbose:
        for size, shape in sorted(seen.values(), reverse=True):
            print(f"  {size / MB:8.4f} MB {shape}")
    planned = sizes_from_config(config.to_dict()).layer_activation_bytes(seq, element=4)[0] * batch
    return {"saved (MB)": sum(size for size, _ in seen.values()) / MB, "planned (MB)": planned / MB}


def engine_terms(vocab: int, schedule: str = "1f1b", batch: int = 16, chunks: int = 4,
                 precision: str = "fp32") -> dict[str, float]:
    """One training step (after a warm-up step) of the `lm` preset `cpu` at `vocab` classes, pp 1, `chunks`
    micro-batches, `precision` (bf16: autocast, the loss on the logits cast to fp32), in a world of one gloo rank:
    the step's peak of live bytes and what the step leaves live (MB), its loss and accuracy, with the engine's
    outputs dropped (`keep_outputs = False`, as `pipetrain train` runs) and kept."""

    from dataclasses import replace

    from torch import nn

    from pipetrain.config import ParallelConfig, PipelineConfig
    from pipetrain.launch.env import free_port
    from pipetrain.launch.ranks import RankSpec
    from pipetrain.pipeline import TokenCrossEntropy
    from pipetrain.session import close_session, open_session
    from pipetrain.workloads.lm.gpt import GPT_PRESETS, GPTModel

    torch.manual_seed(0)
    config = replace(GPT_PRESETS["cpu"], vocab_size=vocab, dropout=0.0)
    model = GPTModel(config)
    x = torch.randint(1, vocab, (batch, config.seq_len))
    y = torch.randint(1, vocab, (batch, config.seq_len))
    session = open_session(RankSpec(0, 0, 1, "127.0.0.1", free_port(), "cpu"), model,
                           ParallelConfig(pipeline=PipelineConfig(pp=1, schedule=schedule, n_microbatches=chunks)),
                           loss_fn=TokenCrossEntropy(), precision=precision)
    out = {"micro-batch logits (MB)": batch // chunks * config.seq_len * vocab * 4 / MB}
    try:
        engine = session.engine
        params = list(engine.parameters())
        for keep in (False, True):
            engine.keep_outputs = keep
            engine.step(x, y)  # warm-up: the schedule is built, the gradients exist
            for p in params:
                p.grad = None
            with LiveBytes() as live:
                result = engine.step(x, y)
                left = live.bytes
            name = "kept" if keep else "dropped"
            out.update({f"{name}: step peak (MB)": live.peak / MB, f"{name}: left after the step (MB)": left / MB,
                        f"{name}: loss": result.loss, f"{name}: accuracy": result.accuracy})
            del result
            gc.collect()
    finally:
        close_session()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lm-vocab", type=int, default=32768)
    parser.add_argument("--lm-schedules", default="1f1b,gpipe")
    parser.add_argument("--lm-precision", default="fp32", help="fp32 or bf16 (the engine's last stage)")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"cross-entropy of {args.tokens} x {args.vocab} fp32 logits (logits-sized units):")
    for name, value in loss_terms(args.tokens, args.vocab).items():
        print(f"  {name}: {value:.3f}")
    print(f"eager llama-cpu layer, {args.batch} x 128 tokens, fp32:")
    for name, value in layer_terms(args.batch, args.verbose).items():
        print(f"  {name}: {value:.4f}")
    for schedule in args.lm_schedules.split(","):
        print(f"the engine's last stage, lm preset cpu at vocabulary {args.lm_vocab}, 16 x 128 tokens, "
              f"4 micro-batches, {schedule}, {args.lm_precision}:")
        for name, value in engine_terms(args.lm_vocab, schedule, precision=args.lm_precision).items():
            print(f"  {name}: {value:.6f}" if "loss" in name or "accuracy" in name else f"  {name}: {value:.1f}")


if __name__ == "__main__":
    main()

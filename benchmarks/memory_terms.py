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
   micro-batches, in a world of one gloo rank: the peak of the bytes the step allocates (the same dispatch mode),
   the `StepResult`'s loss and accuracy, and the planner's kept outputs (`Timeline.kept_bytes`).

Run: `.venv/bin/python benchmarks/memory_terms.py [--vocab 1000] [--tokens 4096] [--batch 4] [--lm-vocab 32768]`.
"""

from __future__ import annotations

import argparse
import gc
import weakref

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from pipetrain.plan.loss import BACKWARD_TEMPORARIES
from pipetrain.plan.transformer import sizes_from_config

MB = 2**20


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages operators create while installed, each counted until it is freed, and their
    peak (`reset` starts a new peak from what is live)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.bytes = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if type(tensor) is not torch.Tensor:  # a DTensor's local ops are counted as they run
                continue
            storage = tensor.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if size and key not in self.live:
                self.live[key] = size
                self.bytes += size
                self.peak = max(self.peak, self.bytes)
                weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key: int) -> None:
        self.bytes -= self.live.pop(key)

    def reset(self) -> None:
        gc.collect()
        self.peak = self.bytes


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"cross-entropy of {args.tokens} x {args.vocab} fp32 logits (logits-sized units):")
    for name, value in loss_terms(args.tokens, args.vocab).items():
        print(f"  {name}: {value:.3f}")
    print(f"eager llama-cpu layer, {args.batch} x 128 tokens, fp32:")
    for name, value in layer_terms(args.batch, args.verbose).items():
        print(f"  {name}: {value:.4f}")


if __name__ == "__main__":
    main()

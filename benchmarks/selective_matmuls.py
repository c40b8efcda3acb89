"""Benchmark: selective recomputation keeping every matrix product or every other one (`--selective-matmuls`).

An eager Hugging Face Llama decoder layer (the `llama-cpu` preset, fp32, `--batch` x `--seq` tokens) runs one forward
and backward under pipetrain's `RecomputeWrapper` with the selective unit, keeping all its matrix products' outputs
(`all`), every other one (`alternate`: torchtitan's op-level policy), and for scale nothing (`layer`: the layer's
input only) and everything (no recomputation). Printed per mode: the bytes the layer holds from its forward to its
backward (the output included, counted by `compat.live.LiveBytes`), the planner's figure
(`DecoderSizes.layer_selective_bytes`, `layer_activation_bytes`), and the forward + backward time relative to
`all`, the modes interleaved over `--repeats` rounds (median, with the spread): this machine is shared and noisy.

Run: `.venv/bin/python benchmarks/selective_matmuls.py [--batch 4] [--seq 256] [--repeats 5]`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from pipetrain.blocks import BlockSequential
from pipetrain.compat.live import LiveBytes
from pipetrain.pipeline.recompute import RecomputeWrapper
from pipetrain.plan.transformer import sizes_from_config

MB = 2**20
MODES = {"none": ("never", "stage", "all"), "all": ("always", "selective", "all"),
         "alternate": ("always", "selective", "alternate"), "layer": ("always", "layer", "all")}


def main() -> None:
    from pipetrain.workloads.hf.causal_lm import HFCausalLM
    from pipetrain.workloads.hf.workload import HF_PRESETS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = HF_PRESETS["llama-cpu"].config()
    model = HFCausalLM(config, seq_len=args.seq)
    embed, layer = model.build_block(0), model.build_block(1)
    with torch.no_grad():
        hidden = embed(torch.randint(0, config.vocab_size, (args.batch, args.seq)))
    inputs = tuple(t.detach().requires_grad_(t.is_floating_point())
                   for t in (hidden if isinstance(hidden, tuple) else (hidden,)))
    stages = {name: RecomputeWrapper(BlockSequential(layer), policy, unit=unit, matmuls=matmuls)
              for name, (policy, unit, matmuls) in MODES.items()}
    held: dict[str, float] = {}
    grads: dict[str, torch.Tensor] = {}
    for name, stage in stages.items():
        stage.start_step(1)
        layer.zero_grad(set_to_none=True)
        with LiveBytes() as live:
            out = stage(*inputs)
            held[name] = live.bytes / MB
        (out[0] if isinstance(out, tuple) else out).square().mean().backward()
        grads[name] = torch.cat([p.grad.flatten() for p in layer.parameters()])
        del out
    for name in MODES:
        torch.testing.assert_close(grads[name], grads["none"], rtol=1e-5, atol=1e-6)  # the same gradients
    times: dict[str, list[float]] = {name: [] for name in MODES}
    for _ in range(args.repeats):
        for name, stage in stages.items():
            stage.start_step(1)
            start = time.perf_counter()
            out = stage(*inputs)
            (out[0] if isinstance(out, tuple) else out).square().mean().backward()
            times[name].append(time.perf_counter() - start)
            del out
    sizes = sizes_from_config(config.to_dict())
    tokens, element = args.batch * args.seq, 4
    planned = {"none": sizes.layer_activation_bytes(args.seq, element=element)[0] * args.batch,
               "all": sizes.layer_selective_bytes(args.seq, element) * args.batch,
               "alternate": sizes.layer_selective_bytes(args.seq, element, "alternate") * args.batch,
               "layer": float(element * tokens * sizes.hidden)}
    base = statistics.median(times["all"])
    print(f"llama-cpu layer, {args.batch} x {args.seq} tokens, fp32; {args.repeats} rounds, load "
          f"{os.getloadavg()[0]:.1f}; gradients equal in every mode (rtol 1e-5)")
    print("| mode | held to backward (MB) | planned (MB) | measured / planned | fwd+bwd / all (median, range) |")
    print("|---|---:|---:|---:|---:|")
    for name in MODES:
        ratios = sorted(t / base for t in times[name])
        print(f"| {name} | {held[name]:.2f} | {planned[name] / MB:.2f} | {held[name] * MB / planned[name]:.3f} | "
              f"{statistics.median(ratios):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f}) |")


if __name__ == "__main__":
    main()

"""One device, one rank: pipetrain's pp=1 step against a plain PyTorch loop on the same model and batch, for
scripts/gpu-check.sh (which runs it on one GPU; its `--dry-run` runs it on the CPU at the tiny size).

Measured, every time synchronised through `pipetrain.pipeline.clock` (CUDA: the device's work, not its launches):
the median step of pipetrain (`--chunks` micro-batches, `--checkpoint` policy) and of the plain loop (the same
blocks as one `nn.Sequential`, the whole batch, the same AdamW), their ratio (pipetrain's overhead), tokens per
second and MFU (PaLM FLOPs over the GPU's dense peak at `--precision`; none on the CPU), peak memory allocated and
reserved (CUDA's caching allocator; the CPU reports its peak resident size), the planner's prediction for the
same run (built-in figures at `--precision`), and the calibration's single-device parts (`compute_figures`: the layer's
rate by micro-batch size, the per-kernel overhead) on this one rank.

Prints one JSON object per run (`--runs`), and one for `--profile`: the per-block profile's forward+backward total.
Run: `PYTHONPATH=src python benchmarks/gpu_step.py --device cuda --preset gpu --calibrate 64 --profile`.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from pipetrain.bench.calibrate_device import compute_figures
from pipetrain.launch.memory import peak_memory_mb, peak_reserved_mb, reset_peak_memory
from pipetrain.blocks import build_sequential
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.launch.env import free_port
from pipetrain.launch.ranks import RankSpec
from pipetrain.logs.meter import model_flops
from pipetrain.logs.mfu import peak_tflops
from pipetrain.pipeline.clock import clock_for
from pipetrain.pipeline.precision import autocast, set_fp32_matmuls
from pipetrain.plan.hardware import DEFAULT_NETWORK, default_device
from pipetrain.plan.model import config_blocks
from pipetrain.plan.predict import Layout, predict
from pipetrain.session import close_session, open_session
from pipetrain.workloads.classifier.presets import PRESETS
from pipetrain.workloads.classifier.model import TransformerClassifier


def _median_step(step, steps: int, warmup: int, clock) -> float:
    for _ in range(warmup):
        step()
    return statistics.median(clock.seconds(step) for _ in range(steps))


def _batch(preset: str, batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    config = PRESETS[preset]
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(1, config.vocab_size, (batch, config.seq_len), generator=generator)
    y = torch.randint(0, 2, (batch,), generator=generator)
    return x.to(device), y.to(device)


def pipetrain_step(args, device: torch.device) -> dict:
    """pipetrain's step at pp=1 (a one-rank gloo/NCCL group in this process), and the calibration's single-device
    parts on that rank."""
    model = TransformerClassifier(PRESETS[args.preset])
    layout = ParallelConfig(pipeline=PipelineConfig(pp=1, schedule="gpipe", n_microbatches=args.chunks,
                                                    checkpoint=args.checkpoint))
    session = open_session(RankSpec(0, 0, 1, "127.0.0.1", free_port(), device.type), model, layout,
                           precision=args.precision)
    try:
        engine = session.engine
        engine.keep_outputs = False
        optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-4)
        x, y = _batch(args.preset, args.batch, session.device)

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            engine.step(x, y)
            optimizer.step()

        step()  # allocates the optimizer state before the peak is reset
        reset_peak_memory(session.device)
        seconds = _median_step(step, args.steps, args.warmup, clock_for(session.device))
        out = {"pipetrain_step_s": seconds, "peak_allocated_mb": peak_memory_mb(session.device),
               "peak_reserved_mb": peak_reserved_mb(session.device)}
        if args.calibrate:
            c = PRESETS[args.preset]
            shape = dict(seq_len=c.seq_len, emsize=c.emsize, nhead=c.nhead, nhid=c.nhid, dropout=c.dropout)
            figures = compute_figures(shape, args.calibrate, session.device, 3)
            out["calibrated_layer_flops_per_s"] = figures["flops_per_s"]
            out["calibrated_rate_by_samples"] = figures["rate_by_samples"]
            out["calibrated_kernel_overhead_s"] = figures["kernel_overhead_s"]
        return out
    finally:
        close_session()


def plain_step(args, device: torch.device) -> float:
    """The same blocks as one `nn.Sequential`, the whole batch at once, AdamW: the loop pipetrain must not slow."""
    model = build_sequential(TransformerClassifier(PRESETS[args.preset]), seed=0, device=device)
    set_fp32_matmuls(device, args.precision)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = _batch(args.preset, args.batch, device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with autocast(device, args.precision):
            loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        optimizer.step()

    return _median_step(step, args.steps, args.warmup, clock_for(device))


def one_run(args, device: torch.device, precision: str, checkpoint: str, calibrate_samples: int) -> dict:
    """The figures of one (precision, recomputation) configuration."""
    run = argparse.Namespace(**{**vars(args), "precision": precision, "checkpoint": checkpoint,
                                "calibrate": calibrate_samples})
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    result = {"device": name, "preset": args.preset, "precision": precision, "batch": args.batch,
              "chunks": args.chunks, "checkpoint": checkpoint, "steps": args.steps, **pipetrain_step(run, device)}
    config = PRESETS[args.preset]
    result["tokens_per_s"] = args.batch * config.seq_len / result["pipetrain_step_s"]
    flops = model_flops(TransformerClassifier(config))
    peak = peak_tflops(name, precision) if device.type == "cuda" else None
    result["mfu"] = (flops.per_step(args.batch, config.seq_len) / result["pipetrain_step_s"] / (peak * 1e12)
                     if flops is not None and peak else None)
    if args.plain:
        result["plain_step_s"] = plain_step(run, device)
        result["overhead_ratio"] = result["pipetrain_step_s"] / result["plain_step_s"]
    layout = Layout(dp=1, pp=1, batch=args.batch, chunks=args.chunks, schedule="gpipe", checkpoint=checkpoint)
    predicted = predict(config_blocks(config), layout, default_device(precision), DEFAULT_NETWORK)
    result["predicted_step_s"] = predicted.step_s
    result["predicted_over_measured"] = predicted.step_s / result["pipetrain_step_s"]
    return result


def profiled(args, device: torch.device) -> dict:
    """`pipetrain profile`'s per-block times (synchronised on CUDA) summed, for the whole batch as one micro-batch."""
    from pipetrain.partition.measure import profile_model

    profile = profile_model(TransformerClassifier(PRESETS[args.preset]), args.batch, device=device.type,
                            repeats=max(1, args.steps // 2), warmup=1)
    return {"profile_forward_backward_s": sum(b.time_s for b in profile.blocks), "profile_device": profile.device}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--preset", default="gpu", choices=tuple(PRESETS))
    parser.add_argument("--runs", default="bf16:never,fp32:never,bf16:always",
                        help="PRECISION:CHECKPOINT configurations, comma-separated (default: bf16 and fp32 (TF32), "
                             "then bf16 with recomputation)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--chunks", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--plain", action=argparse.BooleanOptionalAction, default=True,
                        help="also time the plain PyTorch loop (default: on)")
    parser.add_argument("--calibrate", type=int, default=0, metavar="SAMPLES",
                        help="with the first run, the calibration's layer timing up to SAMPLES samples (0: off)")
    parser.add_argument("--profile", action="store_true", help="also the per-block profile's total")
    args = parser.parse_args()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
    for index, item in enumerate(args.runs.split(",")):
        precision, _, checkpoint = item.partition(":")
        print(json.dumps(one_run(args, device, precision, checkpoint or "never", args.calibrate if index == 0 else 0)),
              flush=True)
    if args.profile:
        print(json.dumps(profiled(args, device)), flush=True)


if __name__ == "__main__":
    main()

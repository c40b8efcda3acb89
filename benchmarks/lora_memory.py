"""Benchmark: what LoRA saves, side by side with a full fine-tune of the same model at pp=2.

For each mode (a full fine-tune; LoRA of `--rank`, alpha 2R, on the family's attention and MLP projections), one
spawned job of 2 ranks (pp=2, 1F1B, 4 micro-batches) builds the model (`--model DIR`, a local Hugging Face folder
such as SmolLM2-135M; default: the `llama-cpu` preset, hidden 64, 4 layers), trains `--steps` AdamW steps on random
token batches of `--batch` x `--seq-len`, and saves one checkpoint. Per rank it reports: the peak memory of the steps
(CUDA: max allocated; CPU: the process's peak RSS above what it held before building the model), the optimizer
state's bytes (AdamW's two moments and step counters, counted tensor by tensor), and the parameters it trains; for
the job, the checkpoint's size on disk. Then the ratios LoRA / full, and, for a `--model DIR`, the planner's
prediction of each rank's memory for the same layout (priced from the folder's config.json, frozen parameters
holding their weights only: `plan.predict`), beside the measured peaks. Run:
`.venv/bin/python benchmarks/lora_memory.py [--model DIR] [--rank 8] [--steps 3] [--batch 8] [--seq-len 128]`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from pipetrain.checkpoint import save_checkpoint
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.launch.env import free_port
from pipetrain.launch.memory import current_memory_mb, peak_memory_mb, reset_peak_memory
from pipetrain.launch.spawn import RankSpec, spawn
from pipetrain.lora import LoraBlocks, LoraSettings, require_peft
from pipetrain.plan.hardware import DEFAULT_NETWORK, default_device
from pipetrain.plan.predict import Layout, predict
from pipetrain.plan.transformer import load_sizes
from pipetrain.recipe import build_optimizer
from pipetrain.session import build_session, close_session, join_job
from pipetrain.train.layout import frozen_costs
from pipetrain.workloads.hf.causal_lm import HFCausalLM, causal_lm_loss
from pipetrain.workloads.hf.workload import HF_PRESETS

PARALLEL = ParallelConfig(pipeline=PipelineConfig(pp=2, schedule="1f1b", n_microbatches=4))


def _model(folder: str | None, seq_len: int, rank: int | None):
    base = (HFCausalLM.from_folder(folder, seq_len=seq_len) if folder else
            HFCausalLM(HF_PRESETS["llama-cpu"].config(), seq_len=seq_len))
    return base if rank is None else LoraBlocks(base, LoraSettings(rank=rank))


def _job(spec: RankSpec, folder: str | None, rank: int | None, steps: int, batch: int, seq_len: int,
         out: str) -> None:
    device = join_job(spec)
    try:
        require_peft()  # imported in both modes before the baseline: its modules are not the model's memory
        reset_peak_memory(device)
        before = current_memory_mb(device)
        model = _model(folder, seq_len, rank)
        session = build_session(model, PARALLEL, device, seed=0, loss_fn=causal_lm_loss)
        engine = session.engine
        optimizer = build_optimizer(engine, 1e-4, 0.0)
        vocab = model.config.vocab_size
        gen = torch.Generator().manual_seed(0)
        for _ in range(steps):
            ids = torch.randint(0, vocab, (batch, seq_len), generator=gen)
            optimizer.zero_grad(set_to_none=True)
            engine.step(ids, ids)
            optimizer.step()
        peak = peak_memory_mb(device) - (before if device.type == "cpu" else 0.0)
        state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                    if isinstance(t, torch.Tensor))
        trained = sum(p.numel() for p in engine.parameters() if p.requires_grad)
        total = sum(p.numel() for p in engine.parameters())
        save_checkpoint(Path(out) / "ckpt", engine, optimizer, step=steps)
        record = {"peak_mb": peak, "optimizer_bytes": state, "trained": trained, "params": total}
        (Path(out) / f"rank{spec.rank}.json").write_text(json.dumps(record))
    finally:
        close_session()


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def measure(folder: str | None, rank: int | None, steps: int, batch: int, seq_len: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        spawn(_job, ranks=range(2), world_size=2, master_addr="127.0.0.1", master_port=free_port(),
              args=(folder, rank, steps, batch, seq_len, out), timeout_s=1800)
        ranks = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(2)]
        return {"ranks": ranks, "checkpoint_bytes": _size(Path(out) / "ckpt")}


def predicted_mb(folder: str, rank: int | None, batch: int, seq_len: int) -> tuple[float, ...]:
    """The planner's memory per pipeline rank (MB) for this benchmark's layout: static bytes (weights, gradients and
    AdamW moments of the trained parameters) plus the schedule's activations, from the folder's config.json."""
    blocks = load_sizes(folder).blocks(seq_len, element=4)
    if rank is not None:
        blocks = frozen_costs(blocks, _model(folder, seq_len, rank))
    layout = Layout(dp=1, pp=2, batch=batch, chunks=PARALLEL.pipeline.n_microbatches, schedule="1f1b")
    return tuple(b / 2 ** 20 for b in predict(blocks, layout, default_device("fp32"), DEFAULT_NETWORK).memory_bytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a local Hugging Face model folder (default: llama-cpu preset)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    full = measure(args.model, None, args.steps, args.batch, args.seq_len)
    lora = measure(args.model, args.rank, args.steps, args.batch, args.seq_len)
    mb = 2 ** 20
    print(f"model: {args.model or 'llama-cpu preset'}, pp=2 1F1B, {args.steps} AdamW steps of {args.batch} x "
          f"{args.seq_len} tokens; LoRA rank {args.rank}")
    print(f"{'':28}{'full':>14}{'LoRA':>14}{'LoRA / full':>14}")
    for r in range(2):
        f, lo = full["ranks"][r], lora["ranks"][r]
        print(f"rank {r} trained parameters  {f['trained']:>14,}{lo['trained']:>14,}{lo['trained'] / f['trained']:>14.4f}")
        print(f"rank {r} optimizer state MB  {f['optimizer_bytes'] / mb:>14.2f}{lo['optimizer_bytes'] / mb:>14.2f}"
              f"{lo['optimizer_bytes'] / max(f['optimizer_bytes'], 1):>14.4f}")
        print(f"rank {r} peak memory MB      {f['peak_mb']:>14.1f}{lo['peak_mb']:>14.1f}"
              f"{lo['peak_mb'] / max(f['peak_mb'], 1e-9):>14.3f}")
    fc, lc = full["checkpoint_bytes"], lora["checkpoint_bytes"]
    print(f"checkpoint size MB          {fc / mb:>14.2f}{lc / mb:>14.2f}{lc / fc:>14.4f}")
    if args.model:  # the planner prices a folder's config (a preset's model is measured only)
        pf, pl = (predicted_mb(args.model, r, args.batch, args.seq_len) for r in (None, args.rank))
        for r in range(2):
            print(f"rank {r} planner's memory MB  {pf[r]:>14.1f}{pl[r]:>14.1f}{pl[r] / pf[r]:>14.3f}")


if __name__ == "__main__":
    main()

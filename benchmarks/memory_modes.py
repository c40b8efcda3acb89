"""Benchmark: what each memory mode holds per rank on the CPU, measured beside the planner's prediction.

Layouts: pp 1 x dp 2 (2 ranks), pp 1 x dp 4 and pp 2 x dp 2 (4 ranks); models: the `lm` workload's `cpu` preset
(priced from a profile measured here, as `--layout auto` prices it) and a tiny Hugging Face Llama folder
(`llama-cpu`, priced from its config.json, as `--model DIR` is). Modes: DDP; FSDP keeping weights gathered; FSDP
resharding after forward (`--fsdp-reshard always`: gradients accumulate sharded); HSDP 2 x 2; whole-stage, every
2nd layer and selective recomputation (`--checkpoint always`); offloading (on the CPU through its host-copy path:
what it moves is reported, nothing leaves the process). One spawned job per world size runs every case in turn,
each model's first case once more, unmeasured, before them (what a process loads once: the model's modules, torch's
kernels paged in, thread pools); per rank and case, after a warm-up step, one measured AdamW step records: the
bytes of this rank's parameters, gradients and optimizer state (counted tensor by tensor: FSDP's local shards), the
peak of the activations saved for backward (a saved-tensor hook around the step that counts each storage while
autograd holds it; weights and views of weights, FSDP's gathered ones included, are static bytes: what the
recomputation and offloading hooks keep out of it is not counted, and selective recomputation's kept products,
held by torch's policy, are not seen), the step's peak of live tensor bytes (`allocated`: every storage alive at
its start — shards, optimizer state, the schedule's receive buffers, DDP's bucket — plus every storage an operator
creates during the step and the optimizer's step, while it lives, and FSDP's gathered weights at the size FSDP
resizes them to: `compat/live.py`), and the process's peak RSS above what it held before the case. The process's figure is planned as the session's
baseline (its RSS once built, before any step, less its weights' shards: modules, FSDP's and the schedule's state,
gloo) plus the plan. glibc keeps freed blocks for reuse below a threshold it raises to the largest block freed (up
to 32 MB): the CPU's counterpart of a caching allocator's reserve, in the RSS; `--exact-malloc` fixes that
threshold at 64 KB (`mallopt`), so that each tensor's memory is mapped and unmapped with it and the RSS follows the
live tensors. The planner's figures for the same layout and mode (`plan.predict`, no device baseline): parameters,
gradients and AdamW state at rest, saved activations (the plan's total less its static bytes, the stage's outputs
and their gradients' receive buffers, the loss backward's temporaries and the backward's working bytes: no saved
tensors, the hook does not see them) and the total. docs/memory.md runs the pp 2 rows at `--batch 128`.
Run: `.venv/bin/python benchmarks/memory_modes.py [--batch 32] [--models lm,hf] [--worlds 2,4] [--exact-malloc]`; `--terms` first runs
benchmarks/memory_terms.py's single-process checks of the planner's terms (the loss's temporaries, an eager Llama
layer's saved tensors, the engine's last stage).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import tempfile
from contextlib import nullcontext
from unittest.mock import patch
from dataclasses import replace
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from pipetrain.compat.live import LiveBytes, live_storages
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.launch.env import free_port
from pipetrain.launch.memory import current_memory_mb, peak_memory_mb, reset_peak_memory
from pipetrain.launch.spawn import RankSpec, spawn
from pipetrain.partition.measure import profile_model
from pipetrain.pipeline import TokenCrossEntropy
from pipetrain.pipeline.offload import ActivationOffload
from pipetrain.plan.hardware import DEFAULT_NETWORK, default_device
from pipetrain.plan import loss as loss_terms
from pipetrain.plan.loss import with_loss
from pipetrain.plan.model import profile_blocks
from pipetrain.plan.predict import Layout, predict, static_bytes
from pipetrain.plan.schedules import rank_stages
from pipetrain.plan.transformer import load_sizes
from pipetrain.session import build_session, close_session, join_job
from pipetrain.train.profiling import selective_form
from pipetrain.workloads.hf.causal_lm import HFCausalLM, causal_lm_loss
from pipetrain.workloads.hf.workload import HF_PRESETS
from pipetrain.workloads.lm.gpt import GPT_PRESETS, GPTModel

MB = 2**20
#: mode -> (dp_mode, fsdp_reshard, dp_shard, checkpoint, recompute_unit, recompute_every, offload)
MODES = {
    "ddp": ("ddp", "never", None, "never", "stage", 1, False),
    "fsdp": ("fsdp", "never", None, "never", "stage", 1, False),
    "fsdp-reshard": ("fsdp", "always", None, "never", "stage", 1, False),
    "hsdp-2x2": ("hsdp", "never", 2, "never", "stage", 1, False),
    "fsdp-ckpt-stage": ("fsdp", "never", None, "always", "stage", 1, False),
    "fsdp-ckpt-layer-2": ("fsdp", "never", None, "always", "layer", 2, False),
    "fsdp-selective": ("fsdp", "never", None, "always", "selective", 1, False),
    "fsdp-offload": ("fsdp", "never", None, "never", "stage", 1, True),
}
#: world -> [(pp, dp, modes)]
LAYOUTS = {
    2: [(1, 2, ("ddp", "fsdp", "fsdp-reshard", "fsdp-ckpt-stage", "fsdp-ckpt-layer-2", "fsdp-selective"))],
    4: [(1, 4, ("fsdp", "fsdp-reshard", "hsdp-2x2")),
        (2, 2, ("ddp", "fsdp", "fsdp-reshard", "fsdp-ckpt-stage", "fsdp-ckpt-layer-2", "fsdp-selective",
                "fsdp-offload"))],
}


def _parallel(pp: int, dp: int, mode: str) -> ParallelConfig:
    dp_mode, reshard, shard, checkpoint, unit, every, offload = MODES[mode]
    pipeline = PipelineConfig(pp=pp, schedule="1f1b" if pp > 1 else "gpipe", n_microbatches=4, checkpoint=checkpoint,
                              recompute_unit=unit, recompute_every=every, offload_activations=offload)
    return ParallelConfig(dp=dp, dp_mode=dp_mode, pipeline=pipeline, fsdp_reshard=reshard, dp_shard=shard)


def _model(name: str, seq_len: int):
    if name == "lm":
        return GPTModel(replace(GPT_PRESETS["cpu"], seq_len=seq_len, dropout=0.0)), TokenCrossEntropy()
    return HFCausalLM(HF_PRESETS["llama-cpu"].config(), seq_len=seq_len), causal_lm_loss


class _SavedPeak:
    """Counts the storages autograd holds for backward (each once), and their peak, while installed; not the
    storages of `weights` (a linear layer saves its weight as a transposed view, no Parameter: the same bytes as the
    parameter, counted with the static ones)."""

    def __init__(self, weights=()) -> None:
        self.live: dict[int, list[int]] = {}  # storage pointer -> [bytes, references]
        self.bytes = self.peak = 0
        self.weights = {(w.to_local() if isinstance(w, DTensor) else w).untyped_storage().data_ptr() for w in weights}

    def pack(self, tensor: torch.Tensor) -> object:
        if isinstance(tensor, (torch.nn.Parameter, DTensor)) or isinstance(tensor._base, torch.nn.Parameter):
            return tensor  # a weight, or a view of one (FSDP's gathered weights: new storages per re-gather)
        key, size = tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()
        if key in self.weights:
            return tensor
        entry = self.live.setdefault(key, [size, 0])
        if entry[1] == 0:
            self.bytes += size
            self.peak = max(self.peak, self.bytes)
        entry[1] += 1
        return _Held(tensor, self, key)

    @staticmethod
    def unpack(held: object) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held

    def drop(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.bytes -= entry[0]
            del self.live[key]


class _Held:
    __slots__ = ("tensor", "owner", "key")

    def __init__(self, tensor: torch.Tensor, owner: _SavedPeak, key: int) -> None:
        self.tensor, self.owner, self.key = tensor, owner, key

    def __del__(self) -> None:
        self.owner.drop(self.key)


def _local_bytes(tensors) -> int:
    out = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if isinstance(t, DTensor) else t
        out += t.numel() * t.element_size()
    return out


def _release() -> None:
    """Give freed memory back to the system, so that RSS counts what the next case holds (glibc keeps it else)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the process peak then includes earlier cases' freed memory
        pass


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return _local_bytes(t for s in optimizer.state.values() for t in s.values()
                        if isinstance(t, torch.Tensor) and t.dim() > 0)


def measured_steps(engine, optimizer: torch.optim.Optimizer, batches: list[tuple],
                   device: torch.device | str = "cpu") -> dict[str, int]:
    """An optimizer step per (inputs, targets) of `batches`, all but the first under the saved-tensor counter and
    the live-bytes counter: this rank's parameter, gradient (of the last step) and optimizer-state bytes, the
    saved-activation peak, the peak of the bytes the process's tensors hold (`allocated`: every storage alive at
    the step's start, `compat/live.py: live_storages` — the weights' shards, the optimizer state, the schedule's
    receive buffers, DDP's bucket — plus every storage an operator creates or FSDP resizes during the step and the
    optimizer's step while it lives; views of the storages alive at the start are not counted again), and the process's peak RSS during the last step above its RSS at its start
    (`step_rss`, MB, glibc's free memory trimmed first)."""
    counter = _SavedPeak(engine.parameters())
    allocated = step_rss = hwm = rss = resting = 0
    for step, (inputs, targets) in enumerate(batches):
        optimizer.zero_grad(set_to_none=True)
        existing = []
        if step:
            hwm = max(hwm, peak_memory_mb(device))
            existing = live_storages()  # before the peak's reset: the collector's list of objects takes memory
            _release()
            reset_peak_memory(device)
            rss = current_memory_mb(device)
        resting = _local_bytes(engine.parameters()) + _state_bytes(optimizer)
        with (LiveBytes(existing=existing) if step else nullcontext()) as live, \
                (torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack) if step else nullcontext()):
            engine.step(inputs, targets)
            grads = _local_bytes(p.grad for p in engine.parameters())
            optimizer.step()
        if step:
            hwm = max(hwm, peak_memory_mb(device))
            allocated, step_rss = live.held + live.peak, peak_memory_mb(device) - rss
            rss -= resting / MB  # what the process holds at the step's start beyond the counted shards and state
    return {"params": _local_bytes(engine.parameters()), "grads": grads, "saved": counter.peak,
            "optimizer": _state_bytes(optimizer), "allocated": allocated, "step_rss": step_rss,
            "peak_rss": hwm, "start_rss": rss}


def _case(name: str, pp: int, dp: int, mode: str, device, batch: int, seq_len: int) -> dict:
    _release()
    reset_peak_memory(device)
    before = current_memory_mb(device)
    model, loss = _model(name, seq_len)
    parallel = _parallel(pp, dp, mode)
    session = build_session(model, parallel, device, seed=0, loss_fn=loss)
    engine, mesh = session.engine, session.mesh
    engine.keep_outputs = False  # as `pipetrain train` runs it: each micro-batch's outputs dropped after its loss
    optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-4)
    _release()  # the session's baseline: what the built session holds beyond its weights' shards, before any step
    baseline = current_memory_mb(device) - before - _local_bytes(engine.parameters()) / MB
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(mesh.dp_rank)
    batches = []
    for _ in range(2):
        ids = torch.randint(1, vocab, (batch // dp, seq_len + (1 if name == "lm" else 0)), generator=gen)
        batches.append((ids[:, :-1], ids[:, 1:]) if name == "lm" else (ids, ids))
    measured = measured_steps(engine, optimizer, batches, device)
    record = {"allocated": measured["allocated"], "step_rss": measured["step_rss"], "baseline_mb": baseline,
              "residue_mb": measured["start_rss"] - before - baseline,
        "params": measured["params"], "grads": measured["grads"], "optimizer": measured["optimizer"],
        "saved_peak": measured["saved"], "offloaded": engine.offloaded_bytes,
        "process_peak_mb": max(measured["peak_rss"], peak_memory_mb(device)) - before, "pp_rank": mesh.pp_rank,
    }
    del session, engine, optimizer
    _release()
    return record


#: glibc's mallopt parameter: the size from which a block gets its own mapping (given, it stops adapting)
M_MMAP_THRESHOLD = -3


def _exact_malloc(threshold: int = 64 * 1024) -> None:
    """Have glibc map every block of `threshold` bytes or more on its own and unmap it when freed, so that the
    resident set follows the live tensors: by default glibc raises that threshold to the largest block freed so
    far (up to 32 MB) and keeps the freed blocks below it for reuse, the CPU's counterpart of a caching
    allocator's reserve."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, threshold)
    except (OSError, AttributeError):  # not glibc: the allocator's reserve stays in the process peak
        pass


def _job(spec: RankSpec, cases: list[tuple], batch: int, seq_len: int, out: str, exact: bool = False) -> None:
    ActivationOffload.HOST_COPY_ON_CPU = True  # the offloading path runs (host-to-host) and reports what it moved
    if exact:
        _exact_malloc()
    device = join_job(spec)
    try:
        warm = {}  # each model's first case once, unmeasured: what a process loads once (the model's modules,
        # torch's kernels paged in, thread pools) is its baseline, not the case's
        for n, pp, dp, m in cases:
            warm.setdefault(n, _case(n, pp, dp, m, device, batch, seq_len))
        records = {f"{n}|{pp}|{dp}|{m}": _case(n, pp, dp, m, device, batch, seq_len) for n, pp, dp, m in cases}
        (Path(out) / f"rank{spec.rank}.json").write_text(json.dumps(records))
    finally:
        close_session()


def _blocks(name: str, seq_len: int, batch: int):
    if name == "lm":
        model, loss = _model(name, seq_len)
        profile = profile_model(model, max(1, batch // 8), repeats=1, selective=selective_form)
        return with_loss(profile_blocks(profile), loss)
    with tempfile.TemporaryDirectory() as folder:
        HF_PRESETS["llama-cpu"].config().save_pretrained(folder)
        return load_sizes(folder).blocks(seq_len, element=4)


def _planned(blocks, pp: int, dp: int, mode: str, batch: int) -> list[dict[str, float]]:
    """What the planner predicts for each pipeline rank (no device baseline): its parameter, gradient and AdamW bytes
    at rest (after the step: FSDP's shards), its static peak within the step, its total (`plan.predict`'s peak),
    and what of that total is a middle stage's outputs (held by torch's stage from each forward to its backward;
    the last stage's die with its loss's forward, `pipeline/head.py`), the loss backward's temporaries and the
    backward's working bytes (the saved-tensor hook sees none of them), so that the rest is its saved activations."""
    dp_mode, reshard, shard, checkpoint, unit, every, offload = MODES[mode]
    layout = Layout(dp=dp, pp=pp, batch=batch, chunks=4, schedule="1f1b" if pp > 1 else "gpipe",
                    checkpoint=checkpoint, dp_mode="fsdp" if dp_mode == "hsdp" else dp_mode,
                    recompute_unit=unit, recompute_every=every, fsdp_reshard=reshard == "always", offload=offload)
    if dp_mode == "hsdp":  # per rank, as FSDP over one shard group with the same local batch
        layout = replace(layout, dp=shard, batch=batch * shard // dp)
    device = replace(default_device("fp32"), baseline_bytes=0.0, activation_factor=1.0, memory_bytes=1e15)
    prediction = predict(blocks, layout, device, DEFAULT_NETWORK)
    with patch.object(loss_terms, "BACKWARD_TEMPORARIES", 0):  # the same plan without the loss's temporaries
        calm = predict(blocks, layout, device, DEFAULT_NETWORK)
    still = predict([replace(b, backward_bytes=0.0) for b in blocks], layout, device, DEFAULT_NETWORK)
    bounds, start = [], 0
    for count in prediction.balance:
        bounds.append((start, start + count))
        start += count
    out = []
    for rank in range(pp):
        mine = [blocks[i] for s in rank_stages(rank, pp, 1, "loop") for i in range(*bounds[s])]
        shards = layout.shards if layout.dp > 1 else 1
        params = sum(b.param_bytes for b in mine) / shards
        trained = sum(b.param_bytes * b.trained_share for b in mine) / shards
        static, total = static_bytes(mine, layout), prediction.memory_bytes[rank]
        end = bounds[rank][1] - 1  # the stage's last block: its outputs are held by torch's stage, not saved
        bare = predict([replace(b, output_bytes=0.0) if i == end else b for i, b in enumerate(blocks)], layout,
                       device, DEFAULT_NETWORK)
        outputs, temporaries = total - bare.memory_bytes[rank], total - calm.memory_bytes[rank]
        work = total - still.memory_bytes[rank]  # the backward's working bytes as it starts
        out.append({"params": params, "grads": trained, "optimizer": 2 * trained, "static": static, "total": total,
                    "outputs": outputs, "temporaries": temporaries + work,
                    "saved": total - static - outputs - temporaries - work})
    return out


def _cell(measured: float, planned: float) -> str:
    """`measured/planned (+x%)` in MB."""
    pct = f"{100 * (measured / planned - 1):+.0f}%" if planned else "-"
    return f"{measured / MB:.2f}/{planned / MB:.2f} {pct:>5}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32, help="global batch (default: 32)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--models", default="lm,hf")
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--terms", action="store_true", help="first, the planner's terms: memory_terms.py")
    parser.add_argument("--exact-malloc", action="store_true",
                        help="each rank's glibc maps blocks of 64 KB or more on their own and unmaps them when freed "
                             "(no reserve of freed blocks: the process peak follows the live tensors)")
    args, rest = parser.parse_known_args()
    if args.terms:
        import sys

        import memory_terms

        sys.argv = [sys.argv[0], *rest]
        memory_terms.main()
    names = args.models.split(",")
    print(f"global batch {args.batch} x {args.seq_len} tokens, 4 micro-batches per replica, fp32, AdamW"
          f"{', exact malloc' if args.exact_malloc else ''}; per rank, measured/planned MB (+-% of planned): "
          "params, grads, optimizer state (after the step), saved activations (peak), allocated (the step's peak of "
          "live tensor bytes), process (peak RSS above the RSS at the case's start, planned: the session's "
          "baseline, measured before its first step, + the plan); base: that baseline; res: what the process holds at "
          "the measured step's start beyond that baseline and the counted tensors (the warm-up step's residue); "
          "offl: MB offloaded")
    print(f"{'model':<5} {'pp':>2} {'dp':>2} {'mode':<17} {'rk':>2} {'params':>16} {'grads':>16} {'optimizer':>16} "
          f"{'saved':>18} {'allocated':>18} {'process':>18} {'base':>5} {'res':>5} {'offl':>5}")
    for world in map(int, args.worlds.split(",")):
        cases = [(n, pp, dp, m) for n in names for pp, dp, modes in LAYOUTS[world] for m in modes]
        with tempfile.TemporaryDirectory() as out:
            spawn(_job, ranks=range(world), world_size=world, master_addr="127.0.0.1", master_port=free_port(),
                  args=(cases, args.batch, args.seq_len, out, args.exact_malloc), timeout_s=3000)
            ranks = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(world)]
        blocks = {n: _blocks(n, args.seq_len, args.batch) for n in names}
        for n, pp, dp, m in cases:
            planned = _planned(blocks[n], pp, dp, m, args.batch)
            for r in range(pp):  # the first replica's ranks: one per pipeline rank
                rec = ranks[r]["|".join(map(str, (n, pp, dp, m)))]
                plan = planned[rec["pp_rank"]]
                print(f"{n:<5} {pp:>2} {dp:>2} {m:<17} {r:>2} {_cell(rec['params'], plan['params']):>16} "
                      f"{_cell(rec['grads'], plan['grads']):>16} {_cell(rec['optimizer'], plan['optimizer']):>16} "
                      f"{_cell(rec['saved_peak'], plan['saved']):>18} {_cell(rec['allocated'], plan['total']):>18} "
                      f"{_cell(rec['process_peak_mb'] * MB, plan['total'] + rec['baseline_mb'] * MB):>18} "
                      f"{rec['baseline_mb']:>5.1f} {rec['residue_mb']:>5.1f} {rec['offloaded'] / MB:>5.1f}")

if __name__ == "__main__":
    main()

"""Parity harness: a few optimizer steps on spawned gloo ranks and on one process, for comparison.

One spawned job runs many configurations in turn (a fresh mesh and engine each), so the suite pays
for process start-up once per world size rather than once per case.
"""

from __future__ import annotations

import gc
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from pipetrain.blocks import build_sequential
from pipetrain.config import ParallelConfig
from pipetrain.launch.env import free_port
from pipetrain.launch.spawn import RankSpec, spawn
from pipetrain.pipeline import IGNORE_INDEX, TokenCrossEntropy
from pipetrain.pipeline.offload import ActivationOffload
from pipetrain.pipeline.precision import autocast
from pipetrain.session import build_session, close_session, join_job
from pipetrain.workloads.lm.gpt import GPT_PRESETS, PAD_ID, GPTEmbedding, GPTModel
from pipetrain.workloads.classifier.model import PRESETS, TransformerClassifier
from tests.tolerances import forward_stages

SEED = 3
LR = 0.05
# the tiny preset with 6 encoder layers: 8 blocks, enough for pp=4 with 2 virtual stages per rank
MODEL_CONFIG = replace(PRESETS["tiny"], nlayers=6)
# forward-only passes after training: a full batch, then a smaller one (torch alone returns stale shapes)
EVAL_BATCHES = [8, 3]


# the tiny causal decoder with 6 layers: (hidden, padding mask) cross every stage, token-level loss
GPT_CONFIG = replace(GPT_PRESETS["tiny"], nlayers=6, seq_len=12)


def make_model() -> TransformerClassifier:
    return TransformerClassifier(MODEL_CONFIG)


def make_gpt() -> GPTModel:
    return GPTModel(GPT_CONFIG)


class _MaskInputEmbedding(GPTEmbedding):
    """The decoder's embedding taking the padding mask as a second input (a first stage with two inputs)."""

    def forward(self, tokens: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return super().forward(tokens)[0], keep


class MaskInputGPT(GPTModel):
    """The decoder fed `(tokens, non-padding mask)`: two tensors into the first stage, two between stages."""

    def build_block(self, index: int):
        return _MaskInputEmbedding(self.config) if index == 0 else super().build_block(index)

    def example_input(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = super().example_input(batch_size)
        return tokens, tokens != PAD_ID


def make_mask_input_gpt() -> MaskInputGPT:
    return MaskInputGPT(GPT_CONFIG)


class _PositionTable(nn.Module):
    """Adds a float position table computed from the input alone: it crosses stages without a gradient."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        table = torch.arange(x.shape[1], dtype=x.dtype, device=x.device).expand(x.shape[0], -1) / x.shape[1]
        return x, table


class _UseTable(nn.Module):
    def __init__(self, width: int, out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, out)

    def forward(self, x: torch.Tensor, table: torch.Tensor):
        return self.linear(x) * (1 + table), table


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.tanh(x + table))


class PositionTableModel:
    """Linear | position table | 2 layers using (x, table) | head: a float tensor without gradient between stages."""

    num_blocks = 5

    def build_block(self, index: int) -> nn.Module:
        return [lambda: nn.Linear(8, 8), _PositionTable, lambda: _UseTable(8, 8), lambda: _UseTable(8, 8), _Head][index]()

    def example_input(self, batch_size: int) -> torch.Tensor:
        return torch.zeros(batch_size, 8)


def make_float_batches(sizes: list[int], seed: int = 13) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 8, generator=gen), torch.randint(0, 2, (n,), generator=gen)) for n in sizes]


def with_mask_input(batches):
    """Token batches with the non-padding mask as a second input."""
    return [((x, x != PAD_ID), y) for x, y in batches]


def _reference_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # the ground truth: the mean over every non-padding token of the whole (global) batch
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX)


def make_token_batches(sizes: list[int], seed: int = 11, widths: list[int] | None = None
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic right-padded token batches (lengths 2..width, so micro-batches hold unequal token
    counts) with next-token targets, padding targets set to the ignore index; `widths` are the batches'
    sequence lengths (default: the model's seq_len)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n, width in zip(sizes, widths or [GPT_CONFIG.seq_len] * len(sizes), strict=True):
        length = width + 1
        tokens = torch.randint(1, GPT_CONFIG.vocab_size, (n, length), generator=gen)
        lengths = torch.randint(2, length + 1, (n,), generator=gen)
        tokens[torch.arange(length)[None, :] >= lengths[:, None]] = PAD_ID
        targets = tokens[:, 1:].clone()
        targets[targets == PAD_ID] = IGNORE_INDEX
        out.append((tokens[:, :-1], targets))
    return out


#: model name -> (BlockModel factory, loss given to the engine, loss of the single-process reference, eval batches)
MODELS = {
    "classifier": (make_model, F.cross_entropy, F.cross_entropy, lambda: make_batches(EVAL_BATCHES)),
    # one shape evaluated twice in a row (one cached forward-only schedule run again), then another
    "classifier-eval-twice": (make_model, F.cross_entropy, F.cross_entropy, lambda: make_batches([8, 8, 3])),
    "gpt": (make_gpt, TokenCrossEntropy(), _reference_token_loss, lambda: make_token_batches(EVAL_BATCHES, seed=5)),
    "table": (PositionTableModel, F.cross_entropy, F.cross_entropy, lambda: make_float_batches(EVAL_BATCHES, seed=17)),
    "gpt-mask-input": (make_mask_input_gpt, TokenCrossEntropy(), _reference_token_loss,
                       lambda: with_mask_input(make_token_batches(EVAL_BATCHES, seed=5))),
}


def _inputs(x):
    return x if isinstance(x, tuple) else (x,)


def bf16_stages(model_name: str, parallel: ParallelConfig) -> int:
    """The bf16 rounding stages on the forward path of a harness transformer under `parallel` (tests/tolerances.py):
    more under tensor parallelism, and under FSDP2 (bf16 parameters and inputs)."""
    config = {"classifier": MODEL_CONFIG, "gpt": GPT_CONFIG}[model_name]
    return forward_stages(config.nlayers, tp=parallel.tp, fsdp=parallel.dp > 1 and parallel.dp_mode == "fsdp")


def make_batches(sizes: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic token batches (the last ones may be short)."""
    gen = torch.Generator().manual_seed(7)
    return [
        (torch.randint(0, MODEL_CONFIG.vocab_size, (n, MODEL_CONFIG.seq_len), generator=gen),
         torch.randint(0, 2, (n,), generator=gen))
        for n in sizes
    ]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def reference_run(batches, model_name: str = "classifier", precision: str = "fp32", clip: float | None = None,
                  *, terms: bool = False) -> dict:
    """Single process, whole batch, plain mean loss, SGD: the ground truth (under autocast for bf16); with
    `clip`, gradients clipped by `torch.nn.utils.clip_grad_norm_` (the norms recorded). With `terms`, also the
    magnitudes the bf16 budget scales with (tests/tolerances.py): per step and parameter sqrt(sum_b ||g_b||^2)
    over the per-sample gradients g_b ("terms"), and the losses' scales from the logits ("loss_scales",
    "eval_loss_scales")."""
    factory, _, loss_fn, eval_batches = MODELS[model_name]
    model = build_sequential(factory(), seed=SEED)
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def forward(x) -> torch.Tensor:
        with autocast("cpu", precision):
            return model(*_inputs(x)).float()

    losses, grads, norms, sample_terms, loss_scales = [], [], [], [], []
    for x, y in batches:
        if terms:
            sample_terms.append(_sample_terms(model, forward, loss_fn, x, y))
        opt.zero_grad()
        logits = forward(x)
        loss = loss_fn(logits, y)
        loss.backward()
        losses.append(loss.item())
        loss_scales.append(_loss_scale(logits.detach(), y))
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    model.eval()
    with torch.no_grad():
        evals, eval_scales = [], []
        for x, y in eval_batches():
            logits = forward(x)
            evals.append((loss_fn(logits, y).item(), logits))
            eval_scales.append(_loss_scale(logits, y))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = {"losses": losses, "grads": grads, "params": params, "evals": evals, "norms": norms}
    if terms:
        out.update(terms=sample_terms, loss_scales=loss_scales, eval_loss_scales=eval_scales)
    return out


def _counted(y: torch.Tensor) -> torch.Tensor:
    """Per row of the loss (sample, or token of a token batch): whether it counts (not padding)."""
    return (y != IGNORE_INDEX).reshape(-1)


def _loss_scale(logits: torch.Tensor, y: torch.Tensor) -> float:
    """sqrt(2) (mean over the counted rows of ||z_row||^2)^(1/2): how far the mean cross-entropy moves per unit of
    relative logit error (tests/tolerances.py, item 3)."""
    rows = logits.reshape(-1, logits.shape[-1])[_counted(y)]
    return (2 * rows.double().pow(2).sum(-1).mean()).sqrt().item()


def _sample_terms(model: nn.Module, forward, loss_fn, x, y) -> dict[str, float]:
    """sqrt(sum_b ||g_b||^2) per parameter, g_b the gradient of sample b's share of the batch's mean loss."""
    counts = _counted(y).reshape(y.shape[0], -1).sum(1)
    squares = {n: 0.0 for n, _ in model.named_parameters()}
    for b in range(y.shape[0]):
        if counts[b] == 0:
            continue
        model.zero_grad()
        sample = tuple(t[b:b + 1] for t in x) if isinstance(x, tuple) else x[b:b + 1]
        (loss_fn(forward(sample), y[b:b + 1]) * (counts[b] / counts.sum())).backward()
        for n, p in model.named_parameters():
            if p.grad is not None:
                squares[n] += p.grad.double().pow(2).sum().item()
    model.zero_grad()
    return {n: value ** 0.5 for n, value in squares.items()}


def _train(parallel: ParallelConfig, batches, device: torch.device, model_name: str = "classifier",
           precision: str = "fp32", clip: float | None = None) -> dict:
    factory, loss, _, eval_batches = MODELS[model_name]
    session = build_session(factory(), parallel, device, seed=SEED, loss_fn=loss, precision=precision)
    engine, mesh = session.engine, session.mesh
    opt = torch.optim.SGD(engine.parameters(), lr=LR)
    losses, grads, norms, offloaded = [], [], [], 0
    for x, y in batches:
        share = y.shape[0] // parallel.dp
        part = slice(mesh.dp_rank * share, (mesh.dp_rank + 1) * share)
        opt.zero_grad()
        share_x = tuple(t[part] for t in x) if isinstance(x, tuple) else x[part]
        losses.append(engine.step(share_x, y[part]).loss)
        offloaded += engine.offloaded_bytes
        if clip is not None:
            norms.append(session.clip_grad_norm_(clip))
        grads.append({name: _full(p.grad).cpu().clone() for name, p in engine.named_parameters()})
        opt.step()
    params = {name: _full(p.detach()).cpu().clone() for name, p in engine.named_parameters()}
    evals = []
    for x, y in eval_batches():
        result = engine.evaluate(x, y)  # every replica evaluates the whole batch here
        evals.append((result.loss, None if result.outputs is None else result.outputs.cpu()))
    gc.collect()
    live_stages = sum(type(o).__name__ == "PipelineStage" for o in gc.get_objects())
    cache = (len(engine.schedules), engine.schedules.evictions, live_stages)
    return {"losses": losses, "grads": grads, "params": params, "evals": evals, "cache": cache, "norms": norms,
            "offloaded": offloaded,
            "capability": torch.backends.cpu.get_cpu_capability()}


def _worker(spec: RankSpec, cases: dict[str, tuple], out: str) -> None:
    ActivationOffload.HOST_COPY_ON_CPU = True  # offloading cases: the CUDA path, with host-to-host copies
    device = join_job(spec)
    try:
        records = {name: _train(parallel, batches, device, *rest) for name, (parallel, batches, *rest) in cases.items()}
        torch.save(records, Path(out) / f"rank{spec.rank}.pt")
    finally:
        close_session()


def parallel_runs(world_size: int, cases: dict[str, tuple], out: Path) -> dict[str, list[dict]]:
    """Run every case (name -> (mesh config, batches[, model name of MODELS[, precision[, clip]]])) on one spawned job;
    returns name -> per-rank records."""
    spawn(_worker, ranks=range(world_size), world_size=world_size, master_addr="127.0.0.1",
          master_port=free_port(), args=(cases, str(out)), timeout_s=600)
    per_rank = [torch.load(out / f"rank{r}.pt") for r in range(world_size)]
    return {name: [records[name] for records in per_rank] for name in cases}


def assert_grads_and_params(ref: dict, record: dict, *, rtol: float, atol: float) -> None:
    """One rank's gradients of every step and final parameters (name -> tensor) equal the reference's."""
    for step, grads in enumerate(record["grads"]):
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref["grads"][step][name], rtol=rtol, atol=atol,
                                       msg=lambda m: f"step {step} gradient of {name}: {m}")
    for name, value in record["params"].items():
        torch.testing.assert_close(value, ref["params"][name], rtol=rtol, atol=atol,
                                   msg=lambda m: f"parameter {name}: {m}")


def assert_parity(ref: dict, records: list[dict], *, rtol: float, atol: float) -> None:
    """Every rank reports the reference losses; every parameter's gradients and final values match."""
    seen = set()
    for record in records:
        torch.testing.assert_close(torch.tensor(record["losses"]), torch.tensor(ref["losses"]), rtol=rtol, atol=atol)
        assert_grads_and_params(ref, record, rtol=rtol, atol=atol)
        seen.update(record["params"])
        for (loss, outputs), (ref_loss, ref_outputs) in zip(record["evals"], ref["evals"], strict=True):
            torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=atol)
            if outputs is not None:
                torch.testing.assert_close(outputs, ref_outputs, rtol=rtol, atol=atol)
    if not any(outputs is not None for record in records for _, outputs in record["evals"]):
        raise AssertionError("evaluate() returned the outputs on no rank")
    missing = set(ref["params"]) - seen
    if missing:
        raise AssertionError(f"parameters held by no rank: {sorted(missing)}")

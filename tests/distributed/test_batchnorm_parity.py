"""ResNet-18 (BatchNorm throughout) pipelined: the losses, gradients, parameters and running statistics of one process.

At `chunks=1` every stage sees the whole batch: the pipelined ResNet-18 equals the unsplit one, running statistics
included, with recomputation too (which re-runs the forward: without `StageNorms.recomputing` the statistics would
move twice). With more micro-batches each micro-batch is normalised by its own statistics: the reference then runs
the unsplit model micro-batch by micro-batch (losses and gradients of the mean over the batch), its statistics moving
once per micro-batch, or, deferred, once per step as the unsplit forward of the whole batch moves them. Under
dp=2 every replica holds the first replica's statistics after each step (DDP's `broadcast_buffers`; FSDP2 alike).

The reference of each case is computed here, in the test process; the ranks compare their own share with it and
send back only what differed. Everything runs in float64: in float32 the
pipelined run's last-bit differences (a loss summed in another order) grow, through ResNet-18's ReLUs and max-pooling,
into gradients that differ by far more than torch's pipelining tolerance (rtol 1e-5, atol 4e-5) after 2 steps:
a relative perturbation of 1e-6 of the first step's gradients moves the third step's by 0.2 at lr 0.05 (7.6e-5 at
lr 0.002, 0.03 on 64x64 images), in one process, no pipeline involved. In float64 the same growth stays near 1e-10,
so the tolerance is rtol 1e-7, atol 1e-8, over 2 SGD steps, then a forward-only pass in eval mode (which normalises
by the running statistics). The float32 path runs in tests/distributed/test_batchnorm_train.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pipetrain.blocks import build_sequential
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.launch.env import free_port
from pipetrain.launch.ranks import RankSpec
from pipetrain.launch.spawn import spawn
from pipetrain.session import build_session, close_session, join_job
from pipetrain.workloads.vision.resnet import RESNET_PRESETS, ResNetModel

RTOL, ATOL = 1e-7, 1e-8
SEED, LR, STEPS, BATCH = 5, 0.05, 2, 16
DTYPE = torch.float64


def _batches(batch: int = BATCH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(17)
    return [(torch.randn(batch, 3, 32, 32, generator=gen, dtype=DTYPE), torch.randint(0, 10, (batch,), generator=gen))
            for _ in range(STEPS + 1)]  # the last one is evaluated


#: ResNet-18 at an eighth of its width (the `tiny` preset): its depth, strides, downsamples and 20 BatchNorms, 1/64 of
#: its 11 M parameters (the ranks compare 2 steps of float64 gradients with the reference's)
CONFIG = RESNET_PRESETS["tiny"]


def _model() -> ResNetModel:
    return ResNetModel(CONFIG)


def _case(pp: int, schedule: str, chunks: int, policy: str = "never", *, deferred: bool = False, dp: int = 1,
          dp_mode: str = "ddp") -> ParallelConfig:
    pipeline = PipelineConfig(pp=pp, schedule=schedule, n_microbatches=chunks, checkpoint=policy,
                              deferred_batchnorm=deferred)
    return ParallelConfig(dp=dp, dp_mode=dp_mode, pipeline=pipeline)


#: world size -> case name -> the layout (micro-batches of 4 or more images: in one of 2, ResNet-18's last stage
#: normalises 2 values per channel, and a last-bit difference grows to 1e-5 in a step, pipeline or not)
CASES = {
    2: {
        "pp2-gpipe-chunks1-always": _case(2, "gpipe", 1, "always"),
        "pp2-1f1b-chunks4": _case(2, "1f1b", 4),
        # split backward: a recomputed forward per half, 2 virtual stages per rank
        "pp2-zero-bubble-chunks4-always": _case(2, "zero-bubble", 4, "always"),
        "pp2-1f1b-chunks4-deferred-except_last": _case(2, "1f1b", 4, "except_last", deferred=True),
    },
    4: {
        "pp4-gpipe-chunks1-always": _case(4, "gpipe", 1, "always"),
        "dp2xpp2-1f1b-chunks2-deferred-fsdp": _case(2, "1f1b", 2, deferred=True, dp=2, dp_mode="fsdp"),
        "dp2xpp2-gpipe-chunks2-ddp": _case(2, "gpipe", 2, dp=2),
    },
}


def reference(parallel: ParallelConfig) -> dict:
    """One process: the unsplit ResNet over the batch cut into dp x chunks micro-batches (each normalised by its
    own statistics; one micro-batch: the plain run), loss the mean over the batch. The running statistics move over
    the first replica's micro-batches only: once per micro-batch, or, deferred, once per step: each BatchNorm then
    runs, as torch's `BatchNorm2d`, on the whole mini-batch of the inputs it saw (a deeper one's inputs were
    normalised per micro-batch upstream, so only the stem's statistics are those of an unsplit forward)."""
    pipeline = parallel.pipeline
    parts, counted = parallel.dp * pipeline.n_microbatches, pipeline.n_microbatches
    net = _reference_net()
    norms = [m for m in net.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    seen: dict[torch.nn.Module, list[torch.Tensor]] = {}
    for norm in norms:
        norm.register_forward_pre_hook(lambda module, args: seen.setdefault(module, []).append(args[0].detach()))
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    *train, (eval_x, eval_y) = _batches()
    losses, grads = [], []
    for x, y in train:
        opt.zero_grad()
        total, inputs = 0.0, {norm: [] for norm in norms}  # what each norm saw of the first replica's share
        for index, (xp, yp) in enumerate(zip(x.chunk(parts), y.chunk(parts), strict=True)):
            kept = {n: b.clone() for n, b in net.named_buffers()}
            seen.clear()
            loss = F.cross_entropy(net(xp), yp, reduction="sum") / x.shape[0] if parts > 1 else F.cross_entropy(
                net(xp), yp)
            loss.backward()
            total += loss.item()
            if pipeline.deferred_batchnorm or index >= counted:  # these micro-batches move no statistics
                with torch.no_grad():
                    for name, buffer in net.named_buffers():
                        buffer.copy_(kept[name])
            if index < counted:
                for norm in norms:
                    inputs[norm].extend(seen[norm])
        if pipeline.deferred_batchnorm:
            with torch.no_grad():
                for norm in norms:
                    torch.nn.functional.batch_norm(torch.cat(inputs[norm]), norm.running_mean, norm.running_var,
                                                   training=True, momentum=norm.momentum, eps=norm.eps)
                    norm.num_batches_tracked.add_(1)
        losses.append(total)
        if not grads:  # the stem's statistics after the first step (before any update, every run starts alike)
            stem = {n: b.clone() for n, b in net.named_buffers() if n.startswith("0.")}
        grads.append({n: p.grad.clone() for n, p in net.named_parameters()})
        opt.step()
    net.eval()
    with torch.no_grad():
        logits = net(eval_x)
    return {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in net.named_parameters()},
            "buffers": {n: b.clone() for n, b in net.named_buffers()}, "stem": stem,
            "eval": (F.cross_entropy(logits, eval_y).item(), logits)}


def _reference_net() -> torch.nn.Module:
    before = torch.get_default_dtype()
    torch.set_default_dtype(DTYPE)  # built as the ranks build it (float64 draws differ from float32 ones)
    try:
        return build_sequential(_model(), seed=SEED)
    finally:
        torch.set_default_dtype(before)


_REFERENCES: dict[tuple[int, int, bool], dict] = {}


def _reference(parallel: ParallelConfig) -> dict:
    """`reference(parallel)`, computed once per (micro-batches, counted ones, deferred)."""
    pipeline = parallel.pipeline
    key = (parallel.dp * pipeline.n_microbatches, pipeline.n_microbatches, pipeline.deferred_batchnorm)
    if key not in _REFERENCES:
        _REFERENCES[key] = reference(parallel)
    return _REFERENCES[key]


def _differences(ref: dict, got: dict) -> list[str]:
    """What differs between the reference and one rank's share (empty when everything is within tolerance)."""
    found = []

    def close(what: str, actual, expected) -> None:
        try:
            torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL)
        except AssertionError as err:
            found.append(f"{what}: {str(err).splitlines()[0:4]}")

    close("losses", torch.tensor(got["losses"]), torch.tensor(ref["losses"]))
    for step, grads in enumerate(got["grads"]):
        for name, grad in grads.items():
            close(f"step {step} gradient of {name}", grad, ref["grads"][step][name])
    for kind in ("params", "buffers"):
        for name, value in got[kind].items():
            close(f"{kind[:-1]} {name}", value, ref[kind][name])
    close("eval loss", torch.tensor(got["eval"][0]), torch.tensor(ref["eval"][0]))
    if got["eval"][1] is not None:
        close("eval logits", got["eval"][1], ref["eval"][1])
    return found


def _run(parallel: ParallelConfig, device: torch.device, ref: dict) -> dict:
    torch.set_default_dtype(DTYPE)  # the blocks are built, and the stage boundaries sized, in float64
    session = build_session(_model(), parallel, device, seed=SEED)
    engine, mesh = session.engine, session.mesh
    opt = torch.optim.SGD(engine.parameters(), lr=LR)
    *train, (eval_x, eval_y) = _batches()
    losses, grads = [], []
    for x, y in train:
        share = slice(mesh.dp_rank * BATCH // parallel.dp, (mesh.dp_rank + 1) * BATCH // parallel.dp)
        opt.zero_grad()
        losses.append(engine.step(x[share], y[share]).loss)
        if not grads:
            stem = {n: b.clone() for n, b in engine.named_buffers() if n.startswith("0.")}
        grads.append({n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
                      for n, p in engine.named_parameters()})
        opt.step()
    params = {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
              for n, p in engine.named_parameters()}
    buffers = {n: b.clone() for n, b in engine.named_buffers()}
    result = engine.evaluate(eval_x, eval_y)
    got = {"losses": losses, "grads": grads, "params": params, "buffers": buffers,
           "eval": (result.loss, result.outputs)}
    return {"differences": _differences(ref, got), "held": sorted(params) + sorted(buffers),
            "buffers": len(buffers), "stem": stem}


def _worker(spec: RankSpec, cases: dict[str, ParallelConfig], references: str, out: str) -> None:
    device = join_job(spec)
    try:
        refs = torch.load(references, weights_only=False)
        records = {name: _run(parallel, device, refs[name]) for name, parallel in cases.items()}
        torch.save(records, Path(out) / f"rank{spec.rank}.pt")
    finally:
        close_session()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, tuple[dict, list[dict]]]:
    """case -> (its reference, each rank's record)."""
    found = {}
    for world, cases in CASES.items():
        folder = tmp_path_factory.mktemp(f"bn-world{world}")
        refs = {name: _reference(parallel) for name, parallel in cases.items()}
        torch.save(refs, folder / "references.pt")
        spawn(_worker, ranks=range(world), world_size=world, master_addr="127.0.0.1", master_port=free_port(),
              args=(cases, str(folder / "references.pt"), str(folder)), timeout_s=600)
        per_rank = [torch.load(folder / f"rank{r}.pt") for r in range(world)]
        found.update({name: (refs[name], [records[name] for records in per_rank]) for name in cases})
    return found


@pytest.mark.parametrize("name", [name for cases in CASES.values() for name in cases])
def test_resnet18_matches_the_unsplit_model(name, results):
    ref, records = results[name]
    for rank, record in enumerate(records):
        assert not record["differences"], f"rank {rank}: " + "\n".join(record["differences"][:10])
    held = {key for record in records for key in record["held"]}
    assert held == set(ref["params"]) | set(ref["buffers"])  # every parameter and running statistic, somewhere
    assert sum(record["buffers"] for record in records) >= 3 * 20  # ResNet-18's 20 BatchNorms, 3 buffers each


@pytest.mark.parametrize("name", ["pp2-1f1b-chunks4-deferred-except_last", "pp2-1f1b-chunks4"])
def test_deferred_statistics_are_the_unsplit_model_s(name, results):
    """The stem's BatchNorm (its input is the images, whatever the micro-batches) after the first step of 4 micro-batches:
    deferred, the unsplit model's statistics of the whole batch; per micro-batch, not (4 updates, each from 4 images)."""
    unsplit = _reference(_case(2, "gpipe", 1))["stem"]
    (stem,) = [record["stem"] for record in results[name][1] if record["stem"]]
    assert set(stem) == {"0.bn1.running_mean", "0.bn1.running_var", "0.bn1.num_batches_tracked"}
    same = all(torch.allclose(stem[n], unsplit[n], rtol=RTOL, atol=ATOL) for n in stem)
    assert same == ("deferred" in name), {n: (stem[n] - unsplit[n]).abs().max().item() for n in stem}


def test_micro_batches_change_the_statistics():
    """The cases differ where they should: the plain run's statistics are not those of micro-batches of 2, nor of a
    deferred step (else the micro-batch cases above would prove nothing about where statistics come from)."""
    plain = _reference(_case(2, "gpipe", 1))["buffers"]
    micro = _reference(_case(2, "1f1b", 4))["buffers"]
    name = "1.0.bn1.running_var"
    assert not torch.allclose(plain[name], micro[name], rtol=RTOL, atol=ATOL)

"""`pipetrain check` without processes: the pure report (tolerances, table, verdict), the tensor comparison,
the hazard probes on single-process models, and the verb's exit codes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipetrain.blocks import BlockSequential, build_blocks
from pipetrain.check import TOLERANCES, CheckReport, Hazard
from pipetrain.check.compare import spread, step_diffs, tensor_rel
from pipetrain.check.reference import probe_hazards, quiet, reference_run, static_hazards
from pipetrain.check.findings import BlockDiff, StepDiff, relative
from pipetrain.cli.main import main
from tests.distributed import check_models


def _report(grad: float = 1e-7, param: float = 1e-8, loss: float = 0.5, hazards=(), spread_: float = 0.0):
    blocks = {0: BlockDiff(1e-7, "0.weight", 1e-8, "0.weight"), 1: BlockDiff(grad, "1.linear.weight", param, "1.bias")}
    steps = [StepDiff(0.5, 0.5, blocks), StepDiff(0.4, loss * 0.8, blocks)]
    return CheckReport(header=["pipetrain check: test"], precision="fp32", tolerances=TOLERANCES["fp32"],
                       labels={0: "Embed", 1: "Mixer"}, steps=steps, hazards=list(hazards), reference_spread=spread_)


def test_within_tolerance_passes_and_states_the_tolerances():
    report = _report()
    lines = report.lines()
    assert report.passed and lines[-1].startswith("PASS")
    assert any(line.startswith("tolerances (fp32): loss 1e-05, gradients 0.0001, parameters 0.0001") for line in lines)
    assert any(line.startswith("1 Mixer") for line in lines) and "hazards: none found" in lines


def test_over_tolerance_fails_naming_the_block_and_the_likely_cause():
    hazard = Hazard("batch statistics", 1, "depends on the batch", cause=True)
    report = _report(grad=3e-2, hazards=[hazard, Hazard("dropout", 0, "switched off")])
    verdict = report.verdict()
    assert not report.passed
    assert verdict[0].startswith("FAIL: 2 figure(s) over tolerance in 1 block(s) (1); worst: gradient of block 1 "
                                 "(Mixer) 1.linear.weight at step 1: 3.0e-02")
    assert verdict[1:] == ["  likely cause: batch statistics: block 1 (Mixer): depends on the batch"]


def test_a_loss_or_a_parameter_alone_fails_too():
    assert not _report(loss=0.51).passed and _report(loss=0.51).over()[0][1] == "loss"
    assert [o[1] for o in _report(param=2e-4).over()] == ["parameter", "parameter"]
    assert not _report(grad=float("nan")).passed  # nan is never within tolerance


def test_a_reference_that_does_not_repeat_fails_whatever_the_layout():
    report = _report(spread_=1e-3)
    assert not report.passed and "the reference itself is not reproducible" in report.verdict()[0]


@pytest.mark.bf16
def test_bf16_tolerances_are_looser():
    fp32, bf16 = TOLERANCES["fp32"], TOLERANCES["bf16"]
    assert bf16.loss > fp32.loss and bf16.grad > fp32.grad and bf16.param > fp32.param
    assert fp32.loss <= 1e-5 and fp32.grad <= 1e-4 and fp32.param <= 1e-4


def test_relative_differences():
    assert relative(0.0, 0.0) == 0.0 and relative(1.0, 0.0) == float("inf") and relative(1.0, -4.0) == 0.25
    ref = torch.tensor([3.0, 4.0])
    assert tensor_rel(ref + torch.tensor([0.0, 0.5]), ref) == pytest.approx(0.1)
    assert tensor_rel(None, None) == 0.0 and tensor_rel(None, ref) == 1.0  # a missing gradient is zeros
    assert tensor_rel(torch.zeros(3), ref) == float("inf")  # another shape


def test_step_diffs_take_the_worst_tensor_of_each_block_over_every_rank():
    ref = {"losses": [1.0], "grads": [{"0.w": torch.ones(2), "1.w": torch.ones(2), "1.b": torch.ones(2)}],
           "params": [{"0.w": torch.ones(2), "1.w": torch.ones(2), "1.b": torch.ones(2)}]}
    rank0 = {"losses": [1.0], "grads": [{"0.w": torch.ones(2)}], "params": [{"0.w": torch.ones(2)}]}
    rank1 = {"losses": [1.0], "grads": [{"1.w": torch.ones(2), "1.b": torch.tensor([1.0, 2.0])}],
             "params": [{"1.w": torch.ones(2), "1.b": torch.ones(2)}]}
    (step,) = step_diffs(ref, [rank0, rank1])
    assert step.blocks[0].grad == 0.0 and step.blocks[1].grad_tensor == "1.b"
    assert step.blocks[1].grad == pytest.approx(2**-0.5)
    (missing,) = step_diffs(ref, [rank0])  # block 1 held by no rank
    assert missing.blocks[1].grad == float("inf")
    assert spread(ref, ref) == 0.0


def _net(workload) -> BlockSequential:
    model = workload.model("tiny")
    blocks = build_blocks(model, range(model.num_blocks), seed=0)
    return BlockSequential(*blocks)


@pytest.mark.parametrize("name, kind", [("batch_stat", "batch statistics"), ("counter", "hidden state")])
def test_the_probes_name_the_block_that_cannot_be_split(name, kind):
    hazards = probe_hazards(_net(getattr(check_models, name)), torch.randn(8, check_models.WIDTH), micro=2)
    assert [(h.kind, h.block, h.cause) for h in hazards] == [(kind, 2, True)]


def test_the_probes_find_nothing_in_a_sound_model_and_randomness_in_a_noisy_one():
    x = torch.randn(8, check_models.WIDTH)
    assert probe_hazards(_net(check_models.sound), x, micro=8) == []  # halves when one micro-batch is the batch

    class Noise(nn.Module):
        def forward(self, h):
            return h + torch.randn_like(h)

    hazards = probe_hazards(BlockSequential(nn.Linear(8, 8), Noise()), x, micro=4)
    assert [(h.kind, h.block) for h in hazards] == [("randomness", 1)]


def test_dropout_is_switched_off_in_modules_and_attention():
    attention = nn.MultiheadAttention(8, 2, dropout=0.1)
    block = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3), attention)
    assert quiet(block) == ["1 p=0.3", "2.dropout=0.1"]
    assert block[1].p == 0.0 and attention.dropout == 0.0 and quiet(block) == []


def test_static_hazards_of_a_model_that_still_trains_the_same():
    workload = check_models.hazards
    model = workload.model("tiny")
    batches = [(torch.randn(4, check_models.WIDTH), torch.randint(0, 3, (4,)))]
    ref = reference_run(model, batches, workload.loss(), seed=0, lr=0.1, precision="fp32", device=torch.device("cpu"))
    net = _net(workload)
    switched = {i: names for i, block in enumerate(net) if (names := quiet(block))}
    kinds = {(h.kind, h.block) for h in static_hazards(net, switched, ref)}
    assert kinds == {("dropout", 2), ("buffer outside the state dict", 2),
                     ("tensor outside parameters and buffers", 2), ("parameter never used", 2)}
    assert reference_run(model, batches, workload.loss(), seed=0, lr=0.1, precision="fp32",
                         device=torch.device("cpu"))["losses"] == ref["losses"]


def test_tied_weights_are_named():
    shared = nn.Linear(4, 4)
    net = BlockSequential(shared, nn.Sequential(shared))
    copy = BlockSequential(nn.Linear(4, 4), nn.Linear(4, 4))
    copy[1].weight.data.copy_(copy[0].weight.data)
    from pipetrain.check.reference import _tied

    assert [(h.kind, h.block) for h in _tied(net)] == [("tied weights", 1), ("tied weights", 1)]
    assert "1.weight equals 0.weight at initialisation" in _tied(copy)[0].detail


def test_the_verb_exits_1_on_fail_and_2_on_a_layout_that_does_not_fit(capsys, monkeypatch):
    import pipetrain.cli.check as verb

    monkeypatch.setattr(verb, "run_check", lambda *a, **k: _report(grad=1.0))
    argv = ["check", "--workload", "tests.distributed.check_models:sound", "--preset", "tiny"]
    assert main(argv + ["--pp", "2"]) == 1
    assert "FAIL" in capsys.readouterr().out
    monkeypatch.setattr(verb, "run_check", lambda *a, **k: _report())
    assert main(argv + ["--pp", "2"]) == 0
    assert main(argv + ["--pp", "8", "--schedule", "gpipe"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pp=8" in err[0] and "the model has 6" in err[0], err


def test_a_layout_that_crashes_fails_with_its_error_and_the_likely_cause():
    from dataclasses import replace

    hazard = Hazard("parameter never used", 2, "2.unused.weight gets no gradient", cause=True)
    report = replace(_report(hazards=[hazard]), steps=[], crashed="RuntimeError: Expected to have finished reduction")
    assert not report.passed
    assert report.lines()[-2:] == ["FAIL: the layout stopped with an error: RuntimeError: Expected to have finished "
                                   "reduction", "  likely cause: parameter never used: block 2 (?): 2.unused.weight "
                                   "gets no gradient"]


def test_an_unused_parameter_is_a_cause_only_under_ddp_replicas():
    from pipetrain.check.run import _crash_line
    from pipetrain.errors import RankFailedError

    workload = check_models.hazards
    batches = [(torch.randn(4, check_models.WIDTH), torch.randint(0, 3, (4,)))]
    ref = reference_run(workload.model("tiny"), batches, workload.loss(), seed=0, lr=0.1, precision="fp32",
                        device=torch.device("cpu"))
    net = _net(workload)
    for ddp in (False, True):
        unused, _bias = [h for h in static_hazards(net, {}, ref, ddp_replicas=ddp) if h.kind == "parameter never used"]
        assert unused.cause is ddp and ("--dp-mode fsdp" in unused.detail) is ddp
    err = RankFailedError("rank 0 failed:\nTraceback (most recent call last):\n  File x\nRuntimeError: boom\n\nmore")
    assert _crash_line(err) == "RuntimeError: boom"

"""DualPipeV's overlapped all-to-all in the planner (`--moe-overlap`): each fused pair hides min(X, C) per side (the
exchange X of one half behind the compute C of the other), nothing at ep 1 or on a CPU whose cores gloo shares; the
search tries both ways where they apply, `plan` marks `+ov` and `--layout auto` / `sbatch` carry the choice."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from pipetrain.cli.main import build_parser, main
from pipetrain.cli.plan import planned
from pipetrain.errors import ConfigError
from pipetrain.plan.auto import Fixed, choose_layout, layout_flags, plainness
from pipetrain.plan.hardware import named_gpu
from pipetrain.plan.loss import last_stage
from pipetrain.plan.predict import Layout, order_of, predict, stage_costs
from pipetrain.plan.search import SearchSpace, enumerate_layouts
from pipetrain.plan.transformer import load_sizes

from tests.unit.test_layout_auto import CALIBRATION, chosen  # noqa: F401  (the fixture: train with no ranks)
from tests.unit.test_moe_ep_cli import folder  # noqa: F401  (the fixture: a tiny Qwen3-MoE folder, 8 experts)

QWEN3_30B = Path(__file__).resolve().parents[2] / "benchmarks" / "models" / "qwen3-30b-a3b" / "config.json"
SEQ = 4096


@pytest.fixture(scope="module")
def blocks():
    return load_sizes(QWEN3_30B).blocks(SEQ, element=2)  # 48 MoE layers of 128 experts, top 8


def _layout(**kw) -> Layout:
    # two nodes of 8 H100: dp 16, one pipeline rank holding DualPipeV's two stages, 4 micro-batches of one sequence
    return Layout(**{**dict(dp=16, pp=1, batch=64, chunks=4, schedule="dualpipev", virtual=2, dp_mode="fsdp",
                            gpus_per_node=8, precision="bf16", ep=16), **kw})


def test_overlap_hides_per_fused_pair_min_of_each_exchange_and_the_other_halfs_compute(blocks):
    device, network = named_gpu("h100-sxm", "bf16")
    off, on = _layout(), _layout(moe_overlap=True)
    # by hand: a MoE block sends each sequence's top-8 hidden states (dispatch) and takes them back (combine), 15/16
    # of them to other ranks, after a call of the 128 experts' int64 counts (forward only); ep 16 spans both nodes,
    # so over the link across them
    latency, bandwidth = network.across_collective()
    per_block = 2 * (blocks[1].experts.dispatch_bytes * 15 / 16 / bandwidth + 15 * latency)  # backward
    assert per_block == pytest.approx(2 * (SEQ * 8 * 2048 * 2 * 15 / 16 / 40e9 + 15 * 5e-6))
    counts = 128 * 8 * 15 / 16 / bandwidth + 15 * latency
    planned = predict(blocks, off, device, network)
    assert planned.balance == (25, 25)  # stage 0: the embedding and 24 MoE layers; stage 1: 24 and the head
    ex_forward, ex_backward = [24 * (per_block + counts)] * 2, [24 * per_block] * 2
    costs = stage_costs(blocks, off, device, network, [(0, 25), (25, 50)])
    costs[-1] = last_stage(costs[-1], blocks[-1], 1, 1)
    forward = [c.forward_s - x for c, x in zip(costs, ex_forward)]  # what the other half's exchange hides behind
    backward = [c.backward_s - x for c, x in zip(costs, ex_backward)]
    order = order_of("dualpipev", 1, 4, 2)[0]
    pairs = [(a.stage, b.stage) for a, b in zip(order, order[1:]) if a.fused]
    assert pairs == [(1, 0), (0, 1), (1, 0), (0, 1), (1, 0)]  # the steady state; warm-up and cool-down unfused
    hidden = sum(min(ex_forward[f], backward[b]) + min(ex_backward[b], forward[f]) for f, b in pairs)
    assert hidden > 0.1 * planned.step_s  # across nodes the exchange outlasts the compute: all compute is hidden
    # one rank runs every action in turn: the step is shorter by exactly what the pairs hide
    assert planned.step_s - predict(blocks, on, device, network).step_s == pytest.approx(hidden, rel=1e-9)
    # ep 1: nothing exchanged, nothing to hide (the flag is not applicable there)
    assert predict(blocks, _layout(ep=1, moe_overlap=True), device, network).step_s == \
        predict(blocks, _layout(ep=1), device, network).step_s
    # the same on a device whose cores gloo shares with the compute: nothing hidden (plan/overlap.py's rule)
    cpu = replace(device, cores=2.0)
    assert predict(blocks, on, cpu, network).step_s == predict(blocks, off, cpu, network).step_s


def test_a_pipeline_across_nodes_is_faster_overlapped(blocks):
    device, network = named_gpu("h100-sxm", "bf16")
    off = _layout(dp=8, pp=2, batch=64, chunks=8, ep=8)
    off_s = predict(blocks, off, device, network).step_s
    on_s = predict(blocks, replace(off, moe_overlap=True), device, network).step_s
    assert on_s < 0.95 * off_s


def test_the_search_tries_the_overlap_only_under_dualpipev_with_experts_split():
    space = SearchSpace(schedules=("1f1b", "dualpipev"), dp_modes=("fsdp",), checkpoints=("never",), eps=(1, 2),
                        moe_overlap=(False, True), balances=("uniform",), max_chunks=4)
    layouts = enumerate_layouts(8, 4, 16, space)
    overlapped = [lay for lay in layouts if lay.moe_overlap]
    assert overlapped and all(lay.schedule == "dualpipev" and lay.ep == 2 for lay in overlapped)
    assert len(overlapped) == sum(1 for lay in layouts if lay.schedule == "dualpipev" and lay.ep == 2) / 2
    assert not any(lay.moe_overlap for lay in enumerate_layouts(8, 4, 16, replace(space, moe_overlap=(False,))))


def test_layout_auto_chooses_the_overlap_where_it_pays_and_carries_it(blocks):
    device, network = named_gpu("h100-sxm", "bf16")
    device = replace(device, memory_bytes=1e15)
    fixed = Fixed(pp=2, dp=8, schedule="dualpipev", ep=8, chunks=8, checkpoint="never", dp_mode="fsdp")
    best = choose_layout(blocks, world=16, batch=64, device=device, network=network, fixed=fixed,
                         gpus_per_node=8, precision="bf16").prediction
    assert best.layout.moe_overlap and "--moe-overlap on" in " ".join(layout_flags(best))
    kept = choose_layout(blocks, world=16, batch=64, device=device, network=network, gpus_per_node=8,
                         fixed=replace(fixed, moe_overlap=False), precision="bf16").prediction
    assert not kept.layout.moe_overlap and "--moe-overlap" not in layout_flags(kept)
    assert plainness(kept.layout) < plainness(best.layout)  # a tie goes to the fused pairs run in turn
    # --moe-overlap on|off binds only the layouts that can overlap (a 1F1B layout stays allowed)
    assert Fixed(moe_overlap=True).allows(replace(best.layout, schedule="1f1b", moe_overlap=False))
    assert not Fixed(moe_overlap=True).allows(kept.layout)


def test_sbatch_writes_the_chosen_expert_split_overlap_and_context_split():
    from pipetrain.cli.sbatch_auto import _CONSUMED, _expert_flags
    from pipetrain.config import ParallelConfig, PipelineConfig

    pipeline = PipelineConfig(pp=2, schedule="dualpipev", n_microbatches=8, moe_overlap=True)
    assert _expert_flags(ParallelConfig(dp=2, ep=2, dp_mode="fsdp", pipeline=pipeline)) == \
        ["--ep", "2", "--moe-overlap", "on"]
    assert _expert_flags(ParallelConfig(dp=2, ep=2, dp_mode="fsdp", pipeline=replace(pipeline, moe_overlap=False))) \
        == ["--ep", "2"]
    assert _expert_flags(ParallelConfig(dp=2)) == []
    assert _expert_flags(ParallelConfig(dp=1, cp=2, dp_mode="fsdp")) == ["--cp", "2", "--cp-attention", "ring"]
    assert {"--ep", "--moe-overlap", "--cp", "--cp-attention"} <= set(_CONSUMED)  # given ones: the choice instead


def test_plan_marks_the_overlap_and_refuses_it_where_nothing_overlaps(capsys):
    argv = ["plan", "--model", str(QWEN3_30B), "--seq-len", "4096", "--nodes", "2", "--gpus-per-node", "8",
            "--gpu", "h100-sxm", "--gpu-mem", "1000", "--precision", "bf16", "--tp", "1", "--pp", "2", "--ep", "8",
            "--schedules", "dualpipev", "--dp-modes", "fsdp", "--checkpoints", "never", "--batch", "64",
            "--chunks", "8", "--top", "4"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "dualpipevx2+ov" in out and "--moe-overlap on" in out.split("best layout:")[1]
    assert main([*argv, "--moe-overlap", "off"]) == 0
    assert "+ov" not in capsys.readouterr().out
    for bad, why in ((["--schedules", "1f1b"], "no schedule searched"), (["--ep", "1"], "ep is 1")):
        args = build_parser([*argv, *bad, "--moe-overlap", "on"]).parse_args([*argv, *bad, "--moe-overlap", "on"])
        with pytest.raises(ConfigError, match=why):
            planned(args)


def test_train_layout_auto_keeps_a_given_overlap_and_leaves_it_off_on_the_cpu(chosen, folder):
    argv = ["train", "--layout", "auto", "--workload", "hf", "--model", folder, "--data", "synthetic",
            "--seq-len", "16", "--batch-size", "8", "--nproc", "4", "--no-progress", "--calibration",
            str(CALIBRATION), "--schedule", "dualpipev", "--dp", "2", "--pp", "2", "--ep", "2"]
    code, config, err = chosen([*argv, "--moe-overlap", "on"])
    assert code == 0, err
    assert config.parallel.ep == 2 and config.parallel.pipeline.moe_overlap
    code, config, err = chosen(argv)  # searched: on this CPU's figures nothing is hidden, the plainer way wins
    assert code == 0, err
    assert config.parallel.ep == 2 and not config.parallel.pipeline.moe_overlap


def test_a_resize_names_a_given_overlap_as_its_flag():
    from pipetrain.plan.resize import _given

    assert _given(Fixed(ep=2, moe_overlap=True)) == "--ep 2 --moe-overlap on"
    assert _given(Fixed(moe_overlap=False, dp_shard=2)) == "--dp-shard 2 --moe-overlap off"

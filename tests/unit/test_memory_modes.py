"""The memory modes' pieces without a process group: flag checks, the reshard rule, which blocks recompute, what
selective recomputation runs again, and activation offloading through its host-to-host test path."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from pipetrain.blocks import BlockSequential
from pipetrain.cli.parallel_args import add_parallel_arguments, parallel_config
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.errors import ConfigError
from pipetrain.pipeline.offload import ActivationOffload
from pipetrain.pipeline.recompute import RecomputeWrapper, recomputed_blocks
from pipetrain.plan.reshard import reshard_after_forward


def _flags(*argv: str) -> ParallelConfig:
    parser = argparse.ArgumentParser()
    add_parallel_arguments(parser)
    return parallel_config(parser.parse_args(list(argv)))


def test_flags_reach_the_configuration():
    config = _flags("--pp", "1", "--dp", "4", "--dp-mode", "hsdp", "--dp-shard", "2", "--fsdp-reshard", "always",
                    "--checkpoint", "selective", "--offload-activations")
    assert (config.dp_mode, config.dp_shard, config.fsdp_reshard, config.dp_replicas) == ("hsdp", 2, "always", 2)
    pipe = config.pipeline
    assert (pipe.checkpoint, pipe.recompute_unit, pipe.offload_activations) == ("always", "selective", True)
    assert _flags("--pp", "1", "--dp", "4", "--dp-mode", "fsdp", "--fsdp-reshard", "2").fsdp_reshard == 2
    every = _flags("--checkpoint", "except_last", "--recompute-unit", "layer", "--recompute-every", "3").pipeline
    assert (every.recompute_unit, every.recompute_every) == ("layer", 3)
    alternate = _flags("--checkpoint", "selective", "--selective-matmuls", "alternate").pipeline
    assert (alternate.recompute_unit, alternate.selective_matmuls) == ("selective", "alternate")
    assert alternate.recompute_text == "always (selective, alternate matrix products)"


@pytest.mark.parametrize("argv, words", [
    (("--dp", "4", "--pp", "1", "--dp-mode", "hsdp"), "--dp-shard"),
    (("--dp", "4", "--pp", "1", "--dp-mode", "hsdp", "--dp-shard", "3"), "dividing"),
    (("--dp", "4", "--pp", "1", "--dp-shard", "2"), "only hsdp"),
    (("--dp", "2", "--pp", "1", "--fsdp-reshard", "always"), "only FSDP2"),
    (("--dp", "2", "--pp", "1", "--dp-mode", "fsdp", "--fsdp-reshard", "sometimes"), "unknown --fsdp-reshard"),
    (("--dp", "4", "--pp", "1", "--dp-mode", "fsdp", "--fsdp-reshard", "4"), "group size"),
    (("--dp", "4", "--pp", "2", "--dp-mode", "fsdp", "--fsdp-reshard", "2"), "pipeline ranks"),
    (("--dp", "2", "--pp", "2", "--dp-mode", "fsdp", "--schedule", "zero-bubble", "--fsdp-reshard", "always"),
     "split in two"),
    (("--recompute-every", "2", "--checkpoint", "always"), "whole stage"),
    (("--recompute-unit", "layer",), "nothing recomputes"),
    (("--checkpoint", "selective", "--recompute-unit", "layer"), "selective is a unit"),
    (("--checkpoint", "always", "--recompute-unit", "ops"), "recomputation unit"),
    (("--checkpoint", "always", "--recompute-unit", "layer", "--selective-matmuls", "alternate"), "selective"),
])
def test_bad_combinations_are_refused(argv, words):
    with pytest.raises(ConfigError, match=words):
        _flags(*argv)


def test_reshard_rule():
    assert reshard_after_forward("never", pp=1) is False and reshard_after_forward("always", pp=4) is True
    assert reshard_after_forward(2, pp=1) == 2
    assert reshard_after_forward("auto", pp=1) is True  # torchtitan's choice at pp 1
    assert reshard_after_forward("auto", pp=1, split_backward=True) is False
    assert reshard_after_forward("auto", pp=2) is False  # the runtime does not know the memory: keep them gathered
    assert reshard_after_forward("auto", pp=2, gathered_bytes=10.0, budget_bytes=5.0) is True
    assert reshard_after_forward("auto", pp=2, gathered_bytes=4.0, budget_bytes=5.0) is False


def test_every_kth_block_counts_model_blocks_from_one():
    assert recomputed_blocks(0, 4, 1) == [0, 1, 2, 3]
    assert recomputed_blocks(0, 4, 2) == [1, 3]
    assert recomputed_blocks(1, 3, 2) == [0, 2]  # model blocks 1, 2, 3: the 2nd and 4th of the model
    assert recomputed_blocks(0, 2, 3) == []


class _Block(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.up, self.down, self.norm = nn.Linear(width, 2 * width), nn.Linear(2 * width, width), nn.LayerNorm(width)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.norm(x + self.down(torch.nn.functional.gelu(self.up(x))))


def _stage(unit: str, policy: str = "always", every: int = 1, offload: ActivationOffload | None = None,
           matmuls: str = "all"):
    torch.manual_seed(0)
    blocks = BlockSequential(*[_Block() for _ in range(4)])
    return RecomputeWrapper(blocks, policy, unit=unit, every=every, offload=offload, matmuls=matmuls)


def _run(stage: RecomputeWrapper, steps: int = 1) -> dict[str, torch.Tensor]:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        stage.start_step(2)
        for part in x.chunk(2):
            stage(part).square().mean().backward()
    return {n: p.grad.clone() for n, p in stage.named_parameters()}


@pytest.mark.parametrize("unit, policy, every, runs", [
    ("stage", "never", 1, [2, 2, 2, 2]),
    ("stage", "always", 1, [4, 4, 4, 4]),
    ("stage", "except_last", 1, [3, 3, 3, 3]),
    ("layer", "always", 2, [2, 4, 2, 4]),
    ("selective", "always", 1, [4, 4, 4, 4]),
])
def test_each_unit_recomputes_its_blocks_and_keeps_the_gradients(unit, policy, every, runs):
    reference = _run(_stage("stage", "never"))
    stage = _stage(unit, policy, every)
    grads = _run(stage)
    assert [block.calls for block in stage.module] == runs  # forwards of 2 micro-batches, and the recomputed ones
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference[name], rtol=1e-6, atol=1e-7)


def _matmuls_in_backward(stage: RecomputeWrapper) -> int:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(2))
    stage.start_step(1)
    loss = stage(x).square().mean()
    with FlopCounterMode(display=False) as flops:  # counts the products that run (not those handed back kept)
        loss.backward()
    return flops.get_total_flops()


def test_selective_recomputation_leaves_the_head_plain_so_its_logits_die_after_the_loss():
    """On the stage holding the model's last block (`head=True`), selective recomputation leaves that block out: the
    policy would keep its matrix product's output (a language model's logits) to the backward. A head of 16 -> 4096
    on 8 rows (128 KB of logits) and a cross-entropy (it keeps a log-softmax of that size): after the forward and
    the loss, with the outputs dropped, the step holds one logits-sized tensor more when the head is recomputed
    selectively than when it runs plain."""
    from pipetrain.compat.live import LiveBytes

    def held(head: bool) -> int:
        torch.manual_seed(0)
        blocks = BlockSequential(_Block(), nn.Linear(16, 4096))
        stage = RecomputeWrapper(blocks, "always", unit="selective", head=head)
        stage.start_step(1)
        x, target = torch.randn(8, 16), torch.randint(0, 4096, (8,))
        with LiveBytes() as live:
            loss = torch.nn.functional.cross_entropy(stage(x), target)  # the outputs die here (pipeline/head.py)
            kept = live.bytes
        loss.backward()
        assert [b.calls for b in blocks[:1]] == [2]  # the first block is recomputed either way
        return kept

    logits = 8 * 4096 * 4
    assert logits <= held(head=False) - held(head=True) < 2 * logits
    stage = _stage("selective")
    assert stage.recompute_modules == list(stage.module)  # no head: every block
    head = RecomputeWrapper(BlockSequential(_Block(), nn.Linear(16, 4096)), "always", unit="selective", head=True)
    assert head.recompute_modules == [head.module[0]]


def test_selective_recomputation_keeps_the_matrix_products():
    # 4 blocks of 2 linears (16 -> 32 -> 16) on 4 rows: recomputing every block runs its forward products again in
    # the backward (2 x 4 x 16 x 32 x 2 FLOPs per block), except under the selective policy, which kept them
    plain = _matmuls_in_backward(_stage("stage", "never"))
    assert _matmuls_in_backward(_stage("layer")) == plain + 4 * 2 * (2 * 4 * 16 * 32)
    assert _matmuls_in_backward(_stage("selective")) == plain
    # every other product kept: each block's second (its `down`, 32 -> 16) runs again, its first does not
    assert _matmuls_in_backward(_stage("selective", matmuls="alternate")) == plain + 4 * (2 * 4 * 32 * 16)


def test_alternate_products_keep_the_gradients():
    reference = _run(_stage("stage", "never"))
    for name, grad in _run(_stage("selective", matmuls="alternate"), steps=2).items():
        torch.testing.assert_close(grad, 2 * reference[name], rtol=1e-6, atol=1e-7)


def test_offloading_moves_saved_activations_through_host_copies():
    reference = _run(_stage("stage", "never"))
    offload = ActivationOffload(torch.device("cpu"), host_copy=True)
    stage = _stage("stage", "never", offload=offload)
    grads = _run(stage, steps=2)
    # the first of 2 micro-batches offloads what its 4 blocks save (the last does not wait for its backward)
    assert offload.offloaded_bytes > 4 * 4 * 16 * 4
    for name, grad in grads.items():
        torch.testing.assert_close(grad, 2 * reference[name], rtol=1e-6, atol=1e-7)


def test_offloading_on_the_cpu_says_it_does_nothing():
    with pytest.warns(RuntimeWarning, match="does nothing on the CPU"):
        offload = ActivationOffload(torch.device("cpu"))
    stage = _stage("stage", "never", offload=offload)
    _run(stage)
    assert offload.offloaded_bytes == 0


# ---- the planner's terms for these modes -------------------------------------------------------------------------

LLAMA_8B = Path(__file__).resolve().parents[2] / "benchmarks" / "models" / "llama-3.1-8b" / "config.json"


def _eight_b():
    from pipetrain.plan.hardware import named_gpu
    from pipetrain.plan.transformer import read_config, sizes_from_config

    device, network = named_gpu("h100", "bf16")
    return sizes_from_config(read_config(LLAMA_8B)[0]).blocks(8192, element=2), device, network


def _memory(blocks, device, network, **fields) -> float:
    from pipetrain.plan.predict import Layout, predict

    layout = Layout(**{"dp": 8, "pp": 1, "batch": 16, "chunks": 1, "schedule": "gpipe", "dp_mode": "fsdp",
                       "precision": "bf16", **fields})
    return max(predict(blocks, layout, device, network).memory_bytes) / 2**30


def test_the_planner_prices_each_mode_in_the_right_order():
    blocks, device, network = _eight_b()
    kept = _memory(blocks, device, network)
    resharded = _memory(blocks, device, network, fsdp_reshard=True)
    selective = _memory(blocks, device, network, fsdp_reshard=True, checkpoint="always", recompute_unit="selective")
    every2 = _memory(blocks, device, network, fsdp_reshard=True, checkpoint="always", recompute_unit="layer",
                     recompute_every=2)
    layer = _memory(blocks, device, network, fsdp_reshard=True, checkpoint="always", recompute_unit="layer")
    # resharding frees all but two layers' gathered bf16 weights and one layer's fp32 gradient: ~40 GiB of an 8B model
    assert 35 < kept - resharded < 45
    assert layer < every2 < resharded and layer < selective < resharded
    alternate = _memory(blocks, device, network, fsdp_reshard=True, checkpoint="always", recompute_unit="selective",
                        selective_matmuls="alternate")
    assert layer < alternate < selective
    offloaded = _memory(blocks, device, network, chunks=2, offload=True)
    assert offloaded == _memory(blocks, device, network, chunks=2)  # two micro-batches: all of them stay (3 kept)


def test_the_8b_question_finds_a_layout_where_torchtitan_ran():
    from pipetrain.cli.main import build_parser
    from pipetrain.cli.plan import planned

    argv = ["plan", "--model", str(LLAMA_8B), "--gpus", "8", "--gpu-mem", "96", "--batch", "16", "--seq-len", "8192",
            "--precision", "bf16", "--dp-modes", "fsdp", "--pp", "1", "--tp", "1", "--gpu", "h100"]
    result, _ = planned(build_parser(argv).parse_args(argv))
    best = result.best[0].layout
    # one micro-batch of two samples, as torchtitan ran it: the logits' log-softmax (8.4 GB) and the loss backward's
    # two temporaries beside selective recomputation's activations, 92.6 GiB; the logits die with the loss's forward
    # (the last stage computes its loss in its forward, pipeline/head.py): held to the backward they made it 100.4
    assert (best.fsdp_reshard, best.recompute_unit, best.selective_matmuls, best.chunks) == (
        True, "selective", "all", 1)
    assert 85 < max(result.best[0].memory_bytes) / 2**30 < 96
    # keeping every other matrix product (torchtitan's policy; torchtitan measured 82.4 GiB there) holds less
    argv += ["--selective-matmuls", "alternate"]
    alternate = planned(build_parser(argv).parse_args(argv))[0].best[0]
    assert (alternate.layout.selective_matmuls, alternate.layout.chunks) == ("alternate", 1)
    assert 65 < max(alternate.memory_bytes) / 2**30 < max(result.best[0].memory_bytes) / 2**30 - 15


def test_auto_reshards_inside_a_pipeline_only_where_it_must():
    from pipetrain.plan.search import SearchSpace, search

    blocks, device, network = _eight_b()
    fields = {"dp": 4, "pp": 2, "chunks": 4, "schedule": "1f1b", "checkpoint": "always"}
    gathered, resharded = (_memory(blocks, device, network, fsdp_reshard=r, **fields) for r in (False, True))
    assert resharded < gathered
    space = SearchSpace(schedules=("1f1b",), checkpoints=("always",), dp_modes=("fsdp",), balances=("uniform",),
                        only_pp=2, only_chunks=4, fsdp_reshard="auto", precision="bf16")
    for budget, reshards in ((gathered + 1, False), ((gathered + resharded) / 2, True)):
        found = search(blocks, gpus=8, batch=16, device=replace(device, memory_bytes=budget * 2**30),
                       network=network, space=space)
        assert found.best[0].layout.fsdp_reshard is reshards


def test_hsdp_is_priced_as_fsdp_within_a_node_and_searched_only_with_nodes():
    from pipetrain.plan.predict import Layout, static_bytes
    from pipetrain.plan.search import SearchSpace, enumerate_layouts

    blocks, _, _ = _eight_b()
    hsdp = Layout(dp=16, pp=1, batch=32, chunks=1, schedule="gpipe", dp_mode="hsdp", dp_shard=8, precision="bf16")
    fsdp8 = replace(hsdp, dp=8, dp_mode="fsdp", dp_shard=0)
    assert static_bytes(blocks, hsdp) == static_bytes(blocks, fsdp8)
    space = SearchSpace(dp_modes=("hsdp",), schedules=("gpipe",), checkpoints=("never",), only_pp=1)
    assert not enumerate_layouts(len(blocks), 16, 32, space)  # one node assumed: no replicas of shard groups
    assert {lay.dp_shard for lay in enumerate_layouts(len(blocks), 16, 32, space, gpus_per_node=8)} == {8}

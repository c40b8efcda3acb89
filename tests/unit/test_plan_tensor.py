"""The planner's tensor parallelism: hand-computed volumes and memory, TP groups inside a node, and TP where it must be."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipetrain.errors import ConfigError
from pipetrain.plan.hardware import DEFAULT_DEVICE, DEFAULT_NETWORK, Network
from pipetrain.plan.model import transformer_activation_bytes, transformer_blocks
from pipetrain.plan.predict import Layout, block_times, predict, stage_costs
from pipetrain.plan.search import SearchSpace, enumerate_layouts, search
from pipetrain.plan.tensor import allreduce_s, tp_activation_bytes, tp_comm_s, tp_param_bytes, tp_problem

# h = 32, f = 64, s = 32, a = 2, fp32: the `tiny` preset's shape
TINY = dict(vocab_size=1000, seq_len=32, emsize=32, nhead=2, nhid=64, nlayers=4, num_classes=2, dropout=0.1)
BLOCKS = transformer_blocks(**TINY)
NET = Network(p2p_latency_s=1e-5, p2p_bytes_per_s=1e10, inter_latency_s=1e-5, inter_bytes_per_s=1e9,
              collective_latency_s=1e-6, collective_bytes_per_s=1e9)


@pytest.mark.parametrize("t", [1, 2, 4, 8])
@pytest.mark.parametrize("s,b,h,a", [(2048, 1, 12288, 96), (512, 4, 1024, 16)])
def test_activations_follow_korthikanti_table_2(s, b, h, a, t):
    """16-bit activations, f = 4h, dropout: sbh(10 + 24/t + 5as/(ht)); with sequence parallelism sbh(34 + 5as/h)/t."""
    sbh = s * b * h
    assert transformer_activation_bytes(s, b, h, a, tp=t) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert transformer_activation_bytes(s, b, h, a, tp=t, recompute="selective") == pytest.approx(sbh * (10 + 24 / t))
    both = dict(tp=t, sequence_parallel=True)
    assert transformer_activation_bytes(s, b, h, a, **both) == pytest.approx(sbh * (34 + 5 * a * s / h) / t)
    assert transformer_activation_bytes(s, b, h, a, recompute="selective", **both) == pytest.approx(34 * sbh / t)


def test_a_layer_block_divides_as_the_formula():
    layer = BLOCKS[1]
    for t in (1, 2):
        for sp in (False, True):
            want = transformer_activation_bytes(32, 1, 32, 2, ffn=64, element=4, tp=t, sequence_parallel=sp)
            assert tp_activation_bytes(layer, t, sp) == pytest.approx(want)
    assert tp_activation_bytes(BLOCKS[0], 2) == BLOCKS[0].activation_bytes  # the embedding is replicated


def test_parameters_split_and_replicated_by_hand():
    layer = BLOCKS[1]
    # split: QKV 3h² + 3h, output h², MLP in hf + f, MLP out fh = 3072 + 96 + 1024 + 2048 + 64 + 2048 = 8352
    # replicated: output bias h, MLP out bias h, two norms 4h = 192
    assert layer.params == 8352 + 192 and layer.tensor.params == 8352
    assert tp_param_bytes(layer, 2) == 4 * (8352 / 2 + 192)
    assert tp_param_bytes(layer, 4) == 4 * (8352 / 4 + 192)
    assert tp_param_bytes(BLOCKS[0], 4) == BLOCKS[0].param_bytes and tp_param_bytes(BLOCKS[-1], 4) == BLOCKS[-1].param_bytes


def test_communication_volume_by_hand():
    layer, samples = BLOCKS[1], 4
    volume = samples * 32 * 32 * 4  # one (b, s, h) fp32 activation: 16 KiB
    # ring all-reduce over t: 2(t-1)/t * bytes / bandwidth + 2(t-1) latency steps; 2 per forward pass
    assert tp_comm_s(layer, samples, 2, NET) == pytest.approx(2 * (volume / 1e9 + 2e-6))
    assert tp_comm_s(layer, samples, 4, NET) == pytest.approx(2 * (1.5 * volume / 1e9 + 6e-6))
    assert tp_comm_s(layer, samples, 1, NET) == 0 and tp_comm_s(BLOCKS[0], samples, 4, NET) == 0
    assert allreduce_s(volume, 1, NET) == 0
    # a calibrated fixed cost per DTensor collective, per peer: t - 1 times per call, 2 calls per forward
    hosted = replace(NET, tp_collective_s=3e-4)
    assert tp_comm_s(layer, samples, 2, hosted) == pytest.approx(tp_comm_s(layer, samples, 2, NET) + 2 * 3e-4)
    assert tp_comm_s(layer, samples, 4, hosted) == pytest.approx(tp_comm_s(layer, samples, 4, NET) + 2 * 3 * 3e-4)
    # in the stage: every layer's 2 collectives in forward and 2 in backward, with or without sequence parallelism
    device = replace(DEFAULT_DEVICE, kernel_overhead_s=0.0)
    bounds = [(0, len(BLOCKS))]
    for sp in (False, True):
        layout = Layout(dp=1, pp=1, tp=2, batch=8, chunks=2, schedule="gpipe", sequence_parallel=sp)
        (cost,) = stage_costs(BLOCKS, layout, device, NET, bounds)
        compute = [block_times(b, samples, device, 2, sp) for b in BLOCKS]
        per_pass = 4 * 2 * (volume / 1e9 + 2e-6)  # 4 layers
        assert cost.forward_s == pytest.approx(sum(f for f, _ in compute) + per_pass)
        assert cost.backward_s == pytest.approx(sum(b for _, b in compute) + per_pass)
        assert cost.weight_share * cost.backward_s == pytest.approx(0.5 * sum(b for _, b in compute))  # W: no comm


def test_compute_per_rank_divides_by_tp():
    flops_only = replace(DEFAULT_DEVICE, bytes_per_s=1e30, kernel_overhead_s=0.0)
    one, two = block_times(BLOCKS[1], 8, flops_only), block_times(BLOCKS[1], 8, flops_only, 2)
    assert two[0] == pytest.approx(one[0] / 2) and two[1] == pytest.approx(one[1] / 2)
    # launches do not shrink; without sequence parallelism the replicated traffic (norms, residuals) neither
    real = block_times(BLOCKS[1], 8, DEFAULT_DEVICE, 2)[0]
    assert one[0] / 2 < real < block_times(BLOCKS[1], 8, DEFAULT_DEVICE)[0]
    assert block_times(BLOCKS[1], 8, DEFAULT_DEVICE, 2, True)[0] < real


def test_predicted_memory_divides_as_stated():
    device = replace(DEFAULT_DEVICE, baseline_bytes=0.0)
    memory = {}
    for tp, sp in ((1, False), (2, False), (2, True)):
        layout = Layout(dp=1, pp=1, tp=tp, batch=4, chunks=1, schedule="gpipe", sequence_parallel=sp)
        memory[tp, sp] = predict(BLOCKS, layout, device, NET).memory_bytes[0]
    params = sum(tp_param_bytes(b, 2) for b in BLOCKS)
    # the head's outputs are not held: the last stage's loss runs in its forward (plan/loss.py)
    acts = 4 * sum(tp_activation_bytes(b, 2) for b in BLOCKS)
    assert memory[2, False] == pytest.approx(4 * params + acts)  # parameters, gradients, two AdamW moments
    assert memory[2, True] == pytest.approx(4 * params + 4 * sum(tp_activation_bytes(b, 2, True) for b in BLOCKS))
    assert memory[2, True] < memory[2, False] < memory[1, False]


def test_what_tp_must_divide():
    assert tp_problem(BLOCKS, 2) is None
    assert tp_problem(BLOCKS, 4) == "tp=4 does not divide nhead=2"
    assert tp_problem(BLOCKS, 0) == "tp must be a positive integer, got 0"
    odd = transformer_blocks(**{**TINY, "seq_len": 31})
    assert tp_problem(odd, 2) is None  # the sequence splits only under sequence parallelism
    assert tp_problem(odd, 2, True) == "tp=2 does not divide the sequence length 31 (sequence parallelism)"
    no_plan = [replace(b, tensor=None) for b in BLOCKS]
    assert "no tensor-parallel plan" in tp_problem(no_plan, 2)
    with pytest.raises(ConfigError, match="does not divide nhead"):
        predict(BLOCKS, Layout(dp=1, pp=1, tp=4, batch=4, chunks=1, schedule="gpipe"), DEFAULT_DEVICE, NET)
    with pytest.raises(ConfigError, match="across nodes"):
        predict(BLOCKS, Layout(dp=1, pp=1, tp=2, batch=4, chunks=1, schedule="gpipe", gpus_per_node=3),
                DEFAULT_DEVICE, NET)


def test_no_tp_group_across_nodes():
    wide = transformer_blocks(**{**TINY, "nhead": 8})
    space = SearchSpace(tps=(1, 2, 4, 8), schedules=("gpipe", "1f1b"), checkpoints=("never",), max_chunks=4)
    layouts = enumerate_layouts(len(wide), 8, 32, space, gpus_per_node=4)
    assert {lay.tp for lay in layouts} == {1, 2, 4}
    assert all(lay.world_size == 8 and 4 % lay.tp == 0 for lay in layouts)
    result = search(wide, gpus=8, batch=32, device=DEFAULT_DEVICE, network=NET, space=space, gpus_per_node=4, top=50)
    assert all(p.layout.tp <= 4 for p in result.best) and {p.layout.tp for p in result.best} >= {2, 4}


def test_search_with_tp_equals_exhaustive_ranking():
    """The lower bound stays a bound with TP (collectives and split compute): pruning drops no better layout."""
    wide = transformer_blocks(**{**TINY, "nhead": 8, "nlayers": 6})
    space = SearchSpace(tps=(1, 2, 4), schedules=("gpipe", "1f1b", "interleaved-1f1b"), max_chunks=8, virtual=(2,))
    result = search(wide, gpus=8, batch=64, device=DEFAULT_DEVICE, network=NET, space=space, gpus_per_node=8, top=40)
    pairs = [(1, False), (2, True), (4, True)]
    everything = {}
    for lay in enumerate_layouts(len(wide), 8, 64, space, 8, pairs):
        p = predict(wide, lay, DEFAULT_DEVICE, NET)
        everything[replace(lay, balance="uniform"), p.balance] = p.step_s  # "time" giving the uniform split: once
    assert [p.step_s for p in result.best] == pytest.approx(sorted(everything.values())[:40])
    assert {p.layout.tp for p in result.best} >= {1, 2} and result.simulated < result.enumerated


def test_a_model_too_big_for_pp_alone_gets_tp_on_a_fast_node():
    """2 nodes of 8 GPUs, NVLink-class inside (300 GB/s), 1 GB/s between: layers of 2.1 B parameters (8.6 GB in
    fp32) do not fit one 16 GB GPU at any pipeline depth, FSDP included (a stage keeps its parameters and gradients
    whole), so every fitting layout splits them with tp inside a node."""
    big = transformer_blocks(vocab_size=1000, seq_len=128, emsize=16384, nhead=64, nhid=32768, nlayers=4,
                             num_classes=2, dropout=0.0)
    device = replace(DEFAULT_DEVICE, memory_bytes=16 * 2**30)
    network = replace(DEFAULT_NETWORK, collective_bytes_per_s=300e9, inter_bytes_per_s=1e9, p2p_bytes_per_s=300e9)
    space = SearchSpace(tps=(1, 2, 4, 8, 16), max_chunks=8)
    result = search(big, gpus=16, batch=16, device=device, network=network, space=space, gpus_per_node=8, top=5)
    assert result.best and all(p.layout.tp > 1 and 8 % p.layout.tp == 0 for p in result.best)
    with pytest.raises(ConfigError, match="no layout of 16 GPUs fits"):
        search(big, gpus=16, batch=16, device=device, network=network, space=replace(space, tps=(1,)),
               gpus_per_node=8)


def test_tp_table_fills_the_node(capsys):
    from pipetrain.plan.hardware import NODES
    from benchmarks.tp_table import main
    from pipetrain.plan.tp_table import node_cells

    device, network = NODES["a100"]
    cells = node_cells(transformer_blocks(**{**TINY, "nhead": 4}), 4, 32, device, network)
    assert sorted((c.tp, c.pp, c.dp) for c in cells) == [(1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1), (4, 1, 1)]
    assert all(c.best and c.best.layout.world_size == 4 and c.memory_bytes <= device.memory_bytes for c in cells)
    main(["--preset", "tiny", "--gpus", "4", "--node", "h100", "--batch", "32"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| h100")]
    assert len(rows) == 5 and sum("**best**" in row for row in rows) == 1  # tiny has 2 heads: tp 1 and 2 only


def test_calibrated_fixed_costs_of_fsdp_groups_and_dtensor_optimizer_steps():
    from pipetrain.plan.predict import optimizer_s, reduce_s

    net = replace(NET, fsdp_group_s=2e-3)
    fsdp, ddp = (Layout(dp=2, pp=1, batch=8, chunks=1, dp_mode=mode) for mode in ("fsdp", "ddp"))
    assert reduce_s(1e6, fsdp, net, groups=5) == pytest.approx(reduce_s(1e6, fsdp, NET, groups=5) + 5 * 2e-3)
    assert reduce_s(1e6, ddp, net, groups=5) == reduce_s(1e6, ddp, NET)  # DDP: one bucketed all-reduce, no groups
    device = replace(DEFAULT_DEVICE, optimizer_s_per_dtensor=1e-4)
    layers = [b for b in BLOCKS if b.tensor is not None]
    base = optimizer_s(BLOCKS, DEFAULT_DEVICE, tp=2)
    assert optimizer_s(BLOCKS, device, tp=2) == pytest.approx(base + 8 * len(layers) * 1e-4)  # the split tensors
    assert optimizer_s(BLOCKS, device) == optimizer_s(BLOCKS, DEFAULT_DEVICE)  # tp 1, unsharded: no DTensor
    every = sum(b.tensors for b in BLOCKS)
    assert optimizer_s(BLOCKS, device, shards=2) == pytest.approx(optimizer_s(BLOCKS, DEFAULT_DEVICE, shards=2)
                                                                  + every * 1e-4)  # FSDP: every tensor a DTensor

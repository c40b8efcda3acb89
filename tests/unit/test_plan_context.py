"""Context parallelism in the planner: a CP rank costs its share of each sequence, the ring's exchange is hidden
behind the attention it overlaps, all-to-all attention needs whole heads, gradients are reduced over dp · cp,
and `plan --cp` prints it and refuses what cannot split."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pipetrain.cli.main import main
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.errors import ConfigError
from pipetrain.plan.context import context_comm_s, cp_problem
from pipetrain.plan.hardware import named_gpu
from pipetrain.plan.predict import Layout, predict, stage_costs
from pipetrain.plan.search import SearchSpace, enumerate_layouts
from pipetrain.plan.transformer import sizes_from_config

#: SmolLM2-135M's attention (9 heads, 3 key/value heads of 64), 4 layers
CONFIG = dict(model_type="llama", vocab_size=512, hidden_size=576, intermediate_size=1536, num_hidden_layers=4,
              num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192)
DEVICE, NETWORK = named_gpu("h100-sxm", "bf16")


def _blocks(seq: int):
    return sizes_from_config(CONFIG).blocks(seq)


def _layout(**kw) -> Layout:
    return Layout(**{**dict(dp=1, pp=1, batch=2, chunks=1, precision="bf16"), **kw})


def test_a_cp_rank_holds_its_share_of_the_activations_and_the_compute():
    blocks = _blocks(8192)
    one = predict(blocks, _layout(), DEVICE, NETWORK)
    two = predict(blocks, _layout(cp=2), DEVICE, NETWORK)
    one_cost, two_cost = (stage_costs(blocks, lay, DEVICE, NETWORK, [(0, len(blocks))])[0]
                          for lay in (_layout(), _layout(cp=2)))
    assert two_cost.activation_bytes == pytest.approx(one_cost.activation_bytes / 2)
    assert max(two.memory_bytes) < max(one.memory_bytes)
    assert two.step_s < one.step_s
    assert two_cost.reduce_s > 0 == one_cost.reduce_s  # the two CP ranks hold the same weights: their gradients meet


def test_the_ring_hides_behind_long_attention_and_shows_on_short_sequences():
    long, short = _blocks(16384)[1], _blocks(256)[1]
    slow = replace(NETWORK, p2p_bytes_per_s=1e9)
    forward, backward = context_comm_s(long, 2, _layout(cp=4), NETWORK, DEVICE)
    assert forward == pytest.approx(3 * NETWORK.p2p_latency_s)  # hidden: a latency per step
    forward, backward = context_comm_s(short, 2, _layout(cp=4), slow, DEVICE)
    assert forward > 3 * slow.p2p_latency_s and backward > 2 * forward  # the backward's fp32 gradients go round too
    ulysses = context_comm_s(long, 2, _layout(cp=3, cp_attention="ulysses"), NETWORK, DEVICE)
    assert ulysses[0] > 0 and context_comm_s(long, 2, _layout(), NETWORK, DEVICE) == (0.0, 0.0)


def test_what_cannot_split_is_named():
    blocks = _blocks(96)
    assert cp_problem(blocks, 2, "ulysses").startswith("cp=2 does not divide the 9 heads and 3 key/value heads")
    assert cp_problem(blocks, 3, "ulysses") is None  # SmolLM2's heads: all-to-all needs cp 3
    assert cp_problem(blocks, 5, "ring") == "cp=5 does not split the sequence length 96 into 10 equal parts"
    assert "no block of the model has one" in cp_problem(_blocks(96)[:1], 2)
    with pytest.raises(ConfigError, match="does not divide the 9 heads"):
        predict(blocks, _layout(cp=2, cp_attention="ulysses"), DEVICE, NETWORK)


def test_the_search_places_cp_beside_tp_and_a_group_wider_than_a_node_pays_the_network():
    space = SearchSpace(cps=(2,), tps=(1, 4), schedules=("gpipe",), checkpoints=("never",), dp_modes=("fsdp",))
    layouts = enumerate_layouts(6, 8, 8, space, gpus_per_node=4)
    assert {(lay.tp, lay.cp) for lay in layouts} == {(1, 2), (4, 2)}
    assert all(lay.world_size == 8 for lay in layouts)
    block = _blocks(256)[1]
    inside = context_comm_s(block, 2, _layout(cp=2, tp=2, gpus_per_node=4), NETWORK, DEVICE)
    across = context_comm_s(block, 2, _layout(cp=4, tp=2, gpus_per_node=4), NETWORK, DEVICE)
    assert across[0] > inside[0]


def test_the_search_gives_cp_beside_tp_only_layouts_train_runs():
    """cp x tp: FSDP2 over the cp ranks (DDP does not take tp's DTensor parameters), with and without sequence
    parallelism."""
    space = SearchSpace(cps=(2,), tps=(2,), schedules=("gpipe",), checkpoints=("never",))
    layouts = [lay for lay in enumerate_layouts(6, 8, 8, space) if lay.cp > 1 and lay.tp > 1]
    assert layouts and {lay.dp for lay in layouts} == {1, 2}
    assert all(lay.dp_mode == "fsdp" for lay in layouts)
    assert {lay.sequence_parallel for lay in layouts} == {False, True}
    for lay in layouts:  # the layout's train flags pass train's checks
        ParallelConfig(dp=lay.dp, dp_mode=lay.dp_mode, tp=lay.tp, cp=lay.cp, sequence_parallel=lay.sequence_parallel,
                       pipeline=PipelineConfig(pp=lay.pp, schedule=lay.schedule, n_microbatches=lay.chunks))


def test_sequence_parallelism_beside_cp_holds_the_norm_regions_of_a_tp_share_of_the_cp_part():
    """SP beside cp: a rank holds the activations between the TP regions for 1 / (cp * tp) of each sequence and
    moves the SP all-gathers and reduce-scatters of its cp part: at cp 2 it costs what one sequence in two costs
    at cp 1 (batch 2 -> 1), less than cp 2 without SP; tp must divide a cp rank's part."""
    blocks = _blocks(6144)  # 3072 tokens a cp rank, 1024 a tp rank
    costs = {(cp, sp, batch): stage_costs(blocks, _layout(cp=cp, tp=3, sequence_parallel=sp, batch=batch), DEVICE,
                                          NETWORK, [(0, len(blocks))])[0]
             for cp, sp, batch in ((2, True, 2), (1, True, 1), (2, False, 2))}
    assert costs[2, True, 2].activation_bytes == pytest.approx(costs[1, True, 1].activation_bytes)
    assert costs[2, True, 2].activation_bytes < 0.8 * costs[2, False, 2].activation_bytes
    assert costs[2, True, 2].forward_s == pytest.approx(costs[1, True, 1].forward_s, rel=0.2)  # + the ring
    with pytest.raises(ConfigError, match=r"tp=3 does not divide the 4096 tokens a cp rank holds of each sequence "
                                          r"\(sequence parallelism\)"):
        predict(_blocks(8192), _layout(cp=2, tp=3, sequence_parallel=True), DEVICE, NETWORK)


def test_the_search_gives_split_backward_schedules_with_cp_over_fsdp2_only():
    """zero-bubble, zbv, dualpipev with cp: the cp ranks reduce gradients as data ranks, and DDP does not follow a
    split backward, so FSDP2 (train refuses DDP); each layout's flags pass train's checks."""
    space = SearchSpace(cps=(2,), schedules=("1f1b", "zero-bubble", "zbv", "dualpipev"), checkpoints=("never",))
    layouts = [lay for lay in enumerate_layouts(8, 8, 16, space) if lay.cp > 1]
    split = [lay for lay in layouts if lay.schedule != "1f1b"]
    assert split and {lay.schedule for lay in split} == {"zero-bubble", "zbv", "dualpipev"}
    assert all(lay.dp_mode != "ddp" for lay in split) and any(lay.dp_mode == "ddp" for lay in layouts)
    for lay in layouts:
        ParallelConfig(dp=lay.dp, dp_mode=lay.dp_mode, cp=lay.cp, dp_shard=lay.dp_shard if lay.dp_mode == "hsdp"
                       else None, pipeline=PipelineConfig(pp=lay.pp, schedule=lay.schedule, n_microbatches=lay.chunks,
                                                          stages_per_rank=lay.virtual))


def test_plan_cp_prints_the_split_and_refuses_what_cannot(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    common = ["plan", "--model", str(tmp_path), "--gpus", "4", "--gpu", "h100-sxm", "--seq-len", "4096",
              "--batch", "8", "--tp", "1", "--top", "2"]
    assert main([*common, "--cp", "2"]) == 0
    out = capsys.readouterr().out
    assert "/cp2" in out and "at cp=2: each rank holds 2048 tokens of a sequence" in out
    assert main([*common, "--cp", "2", "--cp-attention", "ulysses"]) == 2
    err = capsys.readouterr().err
    assert "--cp 2: cp=2 does not divide the 9 heads" in err and "Traceback" not in err
    sp = [*common[:4], "6", *common[5:-4], "--tp", "3", "--top", "2", "--cp", "2", "--sequence-parallel", "on"]
    assert main(sp) == 2  # 4096 tokens, not cut over tp 3: refused; 6144 planned
    err = capsys.readouterr().err
    assert "tp=3 does not divide the sequence length 4096 (sequence parallelism)" in err, err
    assert main([a if a != "4096" else "6144" for a in sp]) == 0
    assert "/cp2" in capsys.readouterr().out


def test_layout_auto_splits_a_sequence_that_does_not_fit_whole_and_keeps_a_given_cp():
    from pipetrain.plan.auto import Fixed, choose_layout, layout_flags
    from pipetrain.plan.context import context_degrees

    blocks = _blocks(8192)
    assert context_degrees(blocks, 8) == (1, 2, 4, 8) and context_degrees(blocks, 8, "ulysses") == (1,)  # 3 kv heads
    assert context_degrees(_blocks(8190), 8) == (1,)  # 8190 = 2 x 4095: no zig-zag split in 2 x cp parts
    kw = dict(world=4, batch=4, network=NETWORK, precision="bf16")
    whole = choose_layout(blocks, device=DEVICE, **kw).prediction
    assert whole.layout.cp == 1  # it fits whole: the sequence stays on one rank
    tight = replace(DEVICE, memory_bytes=0.6 * max(whole.memory_bytes))
    split = choose_layout(blocks, device=tight, fixed=Fixed(pp=1, dp=1), **kw).prediction
    assert split.layout.cp == 4 and max(split.memory_bytes) <= tight.memory_bytes
    flags = layout_flags(split)
    assert flags[flags.index("--cp") + 1:flags.index("--cp") + 4] == ["4", "--cp-attention", "ring"]
    given = choose_layout(blocks, device=DEVICE, fixed=Fixed(cp=2), **kw).prediction.layout
    assert given.cp == 2
    with pytest.raises(ConfigError, match="no layout of 4 ranks fits"):  # 4 whole sequences over 4 ranks: too big
        choose_layout(blocks, device=tight, fixed=Fixed(pp=1, cp=1, dp_mode="ddp"), **kw)

"""HSDP with context parallelism in the planner: a shard group is dp_shard data replicas with their cp ranks (train's
mesh), the sharded state divides by dp_shard · cp, the FSDP collectives run over those ranks and the all-reduce over
the groups; the search finds such layouts (a node's replicas, or `--dp-shard K`) and `plan` prints them."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pipetrain.cli.main import main
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.plan.hardware import named_gpu
from pipetrain.plan.predict import Layout, predict, reduce_s, static_bytes
from pipetrain.plan.search import SearchSpace, enumerate_layouts
from pipetrain.plan.transformer import sizes_from_config

CONFIG = dict(model_type="llama", vocab_size=512, hidden_size=576, intermediate_size=1536, num_hidden_layers=4,
              num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192)
DEVICE, NETWORK = named_gpu("h100-sxm", "bf16")


def test_the_search_gives_hsdp_shard_groups_of_a_nodes_replicas_with_their_cp_ranks():
    space = SearchSpace(cps=(2,), dp_modes=("hsdp",), schedules=("gpipe", "1f1b"), checkpoints=("never",))
    layouts = [lay for lay in enumerate_layouts(6, 16, 16, space, gpus_per_node=4) if lay.dp_mode == "hsdp"]
    # a node of 4 ranks: pp 1 holds 2 replicas with their 2 cp ranks, pp 2 one replica's 2 cp ranks
    assert {(lay.pp, lay.dp_shard) for lay in layouts} == {(1, 2), (2, 1)}
    assert all(lay.gradient_layout().shards * lay.pp == 4 for lay in layouts)  # a shard group: one node's ranks
    for lay in layouts:  # the layout's train flags pass train's checks
        ParallelConfig(dp=lay.dp, dp_mode=lay.dp_mode, cp=lay.cp, dp_shard=lay.dp_shard,
                       pipeline=PipelineConfig(pp=lay.pp, schedule=lay.schedule, n_microbatches=lay.chunks))
    given = enumerate_layouts(6, 16, 16, replace(space, dp_shard=4), gpus_per_node=4)
    assert {(lay.pp, lay.dp_shard) for lay in given} == {(1, 4)}  # pp 2 has 4 replicas: no group of 4 leaves two


def test_hsdp_with_cp_shards_over_its_replicas_cp_ranks_and_reduces_across_the_groups():
    blocks = sizes_from_config(CONFIG).blocks(4096)
    base = dict(dp=4, pp=1, batch=8, chunks=1, precision="bf16", cp=2, gpus_per_node=4)
    hsdp, fsdp = Layout(dp_mode="hsdp", dp_shard=2, **base), Layout(dp_mode="fsdp", **base)
    grads = hsdp.gradient_layout()
    assert (grads.dp, grads.shards) == (8, 4)  # 2 replicas with their 2 cp ranks each: 4 ranks hold the shards
    params = sum(b.params for b in blocks)
    assert static_bytes(blocks, grads, resting=True) == pytest.approx(16 * params / 4)  # bf16: 16 B / parameter
    assert static_bytes(blocks, fsdp.gradient_layout(), resting=True) == pytest.approx(16 * params / 8)
    # FSDP over a shard group of 4 ranks, then the shards all-reduced over the 2 groups
    param_bytes = sum(b.param_bytes for b in blocks)
    inner = reduce_s(param_bytes, Layout(dp=4, pp=1, batch=8, chunks=1, dp_mode="fsdp"), NETWORK)
    across = reduce_s(param_bytes, grads, NETWORK) - inner
    assert across > 0 and inner < reduce_s(param_bytes, fsdp.gradient_layout(), NETWORK)
    one, other = predict(blocks, hsdp, DEVICE, NETWORK), predict(blocks, fsdp, DEVICE, NETWORK)
    assert max(other.memory_bytes) < max(one.memory_bytes)  # fewer ranks per shard group: more state each


def test_plan_prints_an_hsdp_layout_with_cp_and_refuses_a_shard_group_without_hsdp(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    common = ["plan", "--model", str(tmp_path), "--gpus", "8", "--gpus-per-node", "4", "--gpu", "h100-sxm",
              "--seq-len", "4096", "--batch", "8", "--tp", "1", "--top", "2", "--cp", "2"]
    assert main([*common, "--dp-mode", "hsdp", "--dp-shard", "1"]) == 0
    out = capsys.readouterr().out
    assert "hsdp" in out and "--cp 2" in out and "--dp-mode hsdp" in out and "--dp-shard 1" in out
    assert main([*common, "--dp-mode", "fsdp", "--dp-shard", "2"]) == 2
    err = capsys.readouterr().err
    assert "--dp-shard 2: shard groups are hsdp's" in err and "Traceback" not in err


def test_cp_ranks_are_placed_as_trains_mesh_places_them():
    """rank = ((replica · cp + cp rank) · pp + pp rank) · tp + tp rank: at pp 2 × cp 2 on nodes of 2 GPUs a pipeline
    is one node and a CP group spans two, so the ring pays the network and the stage-to-stage sends do not."""
    from pipetrain.plan.context import _link
    from pipetrain.plan.predict import _crosses_node

    layout = Layout(dp=1, pp=2, batch=2, chunks=2, precision="bf16", cp=2, gpus_per_node=2)
    assert _link(layout, NETWORK)[:2] == (NETWORK.inter_latency_s, NETWORK.inter_bytes_per_s)
    assert _link(replace(layout, gpus_per_node=4), NETWORK)[:2] == (NETWORK.p2p_latency_s, NETWORK.p2p_bytes_per_s)
    assert not _crosses_node(0, layout) and _crosses_node(0, replace(layout, gpus_per_node=1))

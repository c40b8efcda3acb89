"""Prediction and the layout search: sanity of the figures, exact pruning, bounded enumeration, clear errors."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pipetrain.errors import ConfigError
from pipetrain.plan.hardware import DEFAULT_DEVICE, DEFAULT_NETWORK, Calibration, load_calibration, save_calibration
from pipetrain.plan.model import transformer_blocks
from pipetrain.plan.predict import Layout, predict
from pipetrain.plan.search import SearchSpace, enumerate_layouts, search

GPU = dict(vocab_size=30000, seq_len=256, emsize=4096, nhead=16, nhid=4096, nlayers=12, num_classes=2, dropout=0.2)
BLOCKS = transformer_blocks(**GPU)


def test_more_chunks_less_bubble_and_recompute_less_memory():
    base = Layout(dp=1, pp=4, batch=64, chunks=4, schedule="gpipe")
    few, many = predict(BLOCKS, base, DEFAULT_DEVICE, DEFAULT_NETWORK), predict(BLOCKS, replace(base, chunks=16), DEFAULT_DEVICE, DEFAULT_NETWORK)
    assert many.bubble < few.bubble
    again = predict(BLOCKS, replace(base, checkpoint="always"), DEFAULT_DEVICE, DEFAULT_NETWORK)
    assert max(again.memory_bytes) < max(few.memory_bytes) and again.step_s > few.step_s
    one = predict(BLOCKS, replace(base, schedule="1f1b"), DEFAULT_DEVICE, DEFAULT_NETWORK)
    assert max(one.memory_bytes) <= max(few.memory_bytes)


def test_search_equals_exhaustive_ranking():
    """Branch and bound returns exactly the fastest fitting layouts of the full enumeration."""
    device = replace(DEFAULT_DEVICE, memory_bytes=30 * 2**30)
    space = SearchSpace(max_chunks=16)
    result = search(BLOCKS, gpus=8, batch=128, device=device, network=DEFAULT_NETWORK, space=space, top=5)
    everything = [predict(BLOCKS, lay, device, DEFAULT_NETWORK) for lay in enumerate_layouts(len(BLOCKS), 8, 128, space)]
    fitting = sorted((p.step_s for p in everything if max(p.memory_bytes) <= device.memory_bytes))
    assert [p.step_s for p in result.best] == pytest.approx(fitting[:5])
    assert result.simulated < result.enumerated
    assert all(max(p.memory_bytes) > device.memory_bytes for p in result.too_big)


def test_enumeration_of_4096_gpus_is_bounded():
    layouts = enumerate_layouts(len(BLOCKS), 4096, 8192, SearchSpace())
    assert 0 < len(layouts) < 2000
    assert all(lay.dp * lay.pp == 4096 and 8192 % (lay.dp * lay.chunks) == 0 for lay in layouts)


def test_no_layout_divides_the_gpu_count():
    with pytest.raises(ConfigError, match="no layout of 17 GPUs") as err:
        search(BLOCKS, gpus=17, batch=256, device=DEFAULT_DEVICE, network=DEFAULT_NETWORK)
    assert "16" in err.value.hint


def test_nothing_fits_says_the_smallest_memory_that_would():
    device = replace(DEFAULT_DEVICE, memory_bytes=2**30)
    with pytest.raises(ConfigError, match="fits in 1.0 GB") as err:
        search(BLOCKS, gpus=2, batch=16, device=device, network=DEFAULT_NETWORK, space=SearchSpace(max_chunks=4))
    needed = float(err.value.hint.split("--gpu-mem ")[1].split()[0])
    roomy = replace(device, memory_bytes=(needed + 0.01) * 2**30)
    assert search(BLOCKS, gpus=2, batch=16, device=roomy, network=DEFAULT_NETWORK, space=SearchSpace(max_chunks=4)).best


def test_calibration_round_trip_and_malformed(tmp_path):
    device = replace(DEFAULT_DEVICE, rate_by_samples=((1.0, 5e12), (8.0, 9e12)), cores=2, contention=0.1)
    calib = Calibration(device=device, network=DEFAULT_NETWORK, backend="gloo", measured="now")
    save_calibration(calib, tmp_path / "c.json")
    assert load_calibration(tmp_path / "c.json") == calib
    data = json.loads((tmp_path / "c.json").read_text())
    data["network"]["p2p_latency_s"] = "fast"
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="p2p_latency_s"):
        load_calibration(tmp_path / "bad.json")
    data = json.loads((tmp_path / "c.json").read_text())
    data["device"]["rate_by_samples"] = [[8, 9e12], [1, 5e12]]
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="rate_by_samples .* ascending"):
        load_calibration(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="cannot read"):
        load_calibration(tmp_path / "missing.json")


def test_plan_modules_import_no_torch():
    """The simulator and search are pure: no module of pipetrain.plan imports torch itself."""
    import ast
    from pathlib import Path

    import pipetrain.plan

    for path in Path(pipetrain.plan.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n == "torch" or n.startswith("torch.") for n in names), path.name


def test_rank_speeds_share_cores_among_ranks():
    from pipetrain.plan.predict import rank_speeds

    cpu = replace(DEFAULT_DEVICE, cores=2, contention=0.25)
    assert rank_speeds(DEFAULT_DEVICE, Layout(dp=1, pp=4, batch=8, chunks=4)) == ()
    assert rank_speeds(cpu, Layout(dp=1, pp=4, batch=8, chunks=4)) == pytest.approx((1.0, 0.8, 0.8 * 2 / 3, 0.8 / 2))
    assert rank_speeds(cpu, Layout(dp=2, pp=2, batch=8, chunks=4)) == pytest.approx((0.8, 0.4))
    # two ranks per node: a node's two cores are enough whatever the pipeline does elsewhere
    own_nodes = Layout(dp=1, pp=4, batch=8, chunks=4, gpus_per_node=2)
    assert rank_speeds(replace(cpu, contention=0.0), own_nodes) == pytest.approx((1.0,) * 4)


def test_flop_rate_by_micro_batch_size():
    """Measured rates are interpolated in log(samples), constant beyond the measured sizes."""
    device = replace(DEFAULT_DEVICE, rate_by_samples=((1.0, 10.0), (4.0, 20.0), (16.0, 16.0)))
    assert device.flops_at(0.5) == 10.0
    assert device.flops_at(2) == pytest.approx(15.0)
    assert device.flops_at(8) == pytest.approx(18.0)
    assert device.flops_at(64) == 16.0
    assert DEFAULT_DEVICE.flops_at(3) == DEFAULT_DEVICE.flops_per_s


def test_v_layouts_follow_torchs_constraints():
    """zbv: 2 stages per rank, any chunks; dualpipev: 2 stages per rank and at least 2p micro-batches."""
    space = SearchSpace(schedules=("zbv", "dualpipev"), checkpoints=("never",), balances=("uniform",))
    layouts = enumerate_layouts(len(BLOCKS), 8, 128, space)
    assert layouts and all(lay.virtual == 2 and lay.pp > 1 for lay in layouts)
    assert {lay.chunks for lay in layouts if lay.schedule == "zbv" and lay.pp == 4} == {1, 2, 4, 8, 16, 32, 64}
    assert all(lay.chunks >= 2 * lay.pp for lay in layouts if lay.schedule == "dualpipev")
    assert any(lay.schedule == "dualpipev" and lay.chunks == 2 * lay.pp for lay in layouts)
    assert not enumerate_layouts(8, 8, 128, replace(space, only_pp=8))  # 16 stages need 16 blocks


def _one_heavy_block(count: int, heavy: int):
    from pipetrain.plan.model import BlockCost

    return [BlockCost(name=f"b{i}", params=0, param_bytes=2.0**30 if i == heavy else 0.0, activation_bytes=0.0,
                      output_bytes=0.0, forward_flops=1e9) for i in range(count)]


def test_v_placement_puts_the_last_stage_on_rank_0():
    """Rank r holds stages r and 2p-1-r: the last block's parameters weigh on rank 0 under zbv and
    dualpipev, on rank p-1 under the looped interleaved schedule."""
    p = 4
    blocks = _one_heavy_block(2 * p, heavy=2 * p - 1)
    heaviest = {}
    for schedule in ("zbv", "dualpipev", "interleaved-1f1b"):
        layout = Layout(dp=1, pp=p, batch=16, chunks=8, schedule=schedule, virtual=2)
        memory = predict(blocks, layout, DEFAULT_DEVICE, DEFAULT_NETWORK).memory_bytes
        heaviest[schedule] = max(range(p), key=lambda r: memory[r])
        assert max(memory) - min(memory) == pytest.approx(4 * 2.0**30)  # parameters, gradients, 2 moments
    assert heaviest == {"zbv": 0, "dualpipev": 0, "interleaved-1f1b": p - 1}


def test_v_activation_memory_is_the_simulated_orders():
    """The activation part of a V layout's memory is the peak of its own order: zbv holds 1F1B's amount
    (2p stage activations on every rank), dualpipev one stage more."""
    p, chunks = 2, 8
    blocks = transformer_blocks(**{**GPU, "nlayers": 2})  # 4 blocks: one per stage
    peaks = {}
    for schedule in ("zbv", "dualpipev"):
        layout = Layout(dp=1, pp=p, batch=64, chunks=chunks, schedule=schedule, virtual=2)
        bare = [replace(b, activation_bytes=0.0) for b in blocks]
        with_acts = predict(blocks, layout, DEFAULT_DEVICE, DEFAULT_NETWORK).memory_bytes
        without = predict(bare, layout, DEFAULT_DEVICE, DEFAULT_NETWORK).memory_bytes
        peaks[schedule] = [a - b for a, b in zip(with_acts, without)]
    assert all(v > 0 for v in peaks["zbv"])
    assert all(d > z for d, z in zip(peaks["dualpipev"], peaks["zbv"]))


def test_search_ranks_v_layouts_and_renders_their_flags():
    from argparse import Namespace

    from pipetrain.cli.plan import train_args

    device = replace(DEFAULT_DEVICE, memory_bytes=80 * 2**30)
    space = SearchSpace(schedules=("1f1b", "zbv", "dualpipev"), max_chunks=16, only_pp=4)
    result = search(BLOCKS, gpus=4, batch=64, device=device, network=DEFAULT_NETWORK, space=space, top=20)
    v = next(p for p in result.best if p.layout.schedule in ("zbv", "dualpipev"))
    flags = train_args(v, Namespace(profile=None, preset="gpu"))
    at = flags.index("--schedule")
    assert flags[at + 1] == v.layout.schedule and flags[flags.index("--stages-per-rank") + 1] == "2"
    assert len(v.balance) == 8

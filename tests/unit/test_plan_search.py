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

"""GPU figures computed on the CPU with torch.cuda's memory functions patched: the device baseline (context, NCCL
buffers) and the allocator's reservation; calibrated networks keep the unmeasured inter-node links apart; and
`--partition time` measures its blocks on the job's device."""

from __future__ import annotations

from argparse import Namespace

import pytest
import torch

from pipetrain.launch import memory
from pipetrain.bench.calibrate import NOT_MEASURED, measured_network
from pipetrain.cli import train as train_cli
from pipetrain.train import layout as train_layout  # the cost balancing moved here from cli/parallel_args.py
from pipetrain.launch import device as device_mod
from pipetrain.plan.hardware import DEFAULT_NETWORK
from pipetrain.train.loop import TrainConfig

MB = 2**20


def test_device_baseline_and_reserved_on_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (60_000 * MB, 80_000 * MB))  # 20 GB in use
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev=None: 19_000 * MB)  # the allocator holds 19 GB
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda dev=None: 24_000 * MB)
    assert memory.device_baseline_bytes("cuda:0") == 1_000 * MB  # context + NCCL buffers
    assert memory.peak_reserved_mb("cuda:0") == 24_000
    assert memory.peak_reserved_mb("cpu") is None
    assert memory.device_baseline_bytes("cpu") > 0  # the resident set size


def test_calibrated_inter_node_links_stay_the_built_in_ones():
    m = {"p2p_latency_s": 3e-6, "p2p_bytes_per_s": 4e11, "collective_latency_s": 8e-6, "collective_bytes_per_s": 3e11}
    network = measured_network(m)
    assert (network.p2p_latency_s, network.p2p_bytes_per_s) == (3e-6, 4e11)
    assert (network.inter_latency_s, network.inter_bytes_per_s) == (DEFAULT_NETWORK.inter_latency_s,
                                                                    DEFAULT_NETWORK.inter_bytes_per_s)
    assert "inter-node links not measured" in NOT_MEASURED


def test_partition_time_measures_on_the_jobs_device(monkeypatch):
    seen = {}

    def fake_cost_balance(model, pipeline, **kwargs):
        seen["device"] = kwargs["device"]
        raise RuntimeError("stop here")

    monkeypatch.setattr(train_layout, "cost_balance", fake_cost_balance)
    monkeypatch.setattr(device_mod, "gpu_count", lambda: 1)
    monkeypatch.setenv("PIPETRAIN_DEVICE", "cuda")
    config = TrainConfig(preset="tiny", data="synthetic", train_samples=8, test_samples=8, batch_size=8)
    config = TrainConfig(**{**config.__dict__, "parallel": train_cli.parallel_config(Namespace(
        pp=2, dp=1, dp_mode="ddp", schedule="gpipe", chunks=2, checkpoint="never", stages_per_rank=None,
        balance=None, partition="time", mem_cap=None, shape_cache=16))})
    args = Namespace(mem_cap=None, profile=None, device=None)
    with pytest.raises(RuntimeError, match="stop here"):
        train_cli.cost_balanced(config, args, launched=False, say=False)
    assert seen["device"] == "cuda"

"""The device override (`--device`, PIPETRAIN_DEVICE) and the refusal of more local ranks than GPUs, tested on the CPU
with a patched GPU count (no rank is started: every refusal comes before spawning)."""

from __future__ import annotations

import pytest
import torch

from pipetrain.bench.calibrate import calibrate
from pipetrain.bench.grid import Cell
from pipetrain.bench import runner
from pipetrain.bench.runner import run_cell
from pipetrain.errors import ConfigError, LaunchError
from pipetrain.launch import device as device_mod
from pipetrain.launch.device import check_local_ranks, pick_device, resolve_device
from pipetrain.launch.env import ClusterEnv, device_override
from pipetrain.launch.sbatch import SbatchRequest, render_sbatch
from pipetrain.launch.spawn import launch_local, spawn
from tests.unit.test_cli_errors import assert_one_error, cli  # noqa: F401  (the in-process CLI fixture)


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has N GPUs (torch.cuda itself is never called for them)."""

    def set_count(count: int) -> None:
        monkeypatch.setattr(device_mod, "gpu_count", lambda: count)
        monkeypatch.setattr(runner, "gpu_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)

    return set_count


def _never(spec) -> None:  # a rank that must not start
    raise AssertionError("a rank started")


def test_the_cpu_tier_is_pinned_to_the_cpu_even_with_gpus(gpus, pinned_device):
    gpus(2)
    assert pinned_device == "cpu" and device_override() == "cpu"
    assert pick_device(1) == torch.device("cpu")
    assert resolve_device() == "cpu"


def test_override_values(monkeypatch, gpus):
    assert device_override({}) is None and device_override({"PIPETRAIN_DEVICE": ""}) is None
    assert device_override({"PIPETRAIN_DEVICE": " CUDA "}) == "cuda"
    with pytest.raises(LaunchError, match="PIPETRAIN_DEVICE='gpu' is not a device type"):
        device_override({"PIPETRAIN_DEVICE": "gpu"})
    monkeypatch.delenv("PIPETRAIN_DEVICE")
    gpus(0)
    assert resolve_device() == "cpu"
    gpus(2)
    assert resolve_device() == "cuda" and resolve_device("cpu") == "cpu"  # CUDA preferred unless told
    assert pick_device(3, "cuda") == torch.device("cuda", 1)  # a rank bound to its own GPUs sees fewer


def test_cuda_without_a_gpu_is_one_error(monkeypatch, gpus):
    monkeypatch.delenv("PIPETRAIN_DEVICE")
    gpus(0)
    with pytest.raises(ConfigError, match="--device cuda but .*(CPU-only build|finds no CUDA device)") as info:
        resolve_device("cuda")
    assert "--device cpu" in info.value.hint
    monkeypatch.setenv("PIPETRAIN_DEVICE", "cuda")
    with pytest.raises(ConfigError, match="PIPETRAIN_DEVICE=cuda but"):
        resolve_device()


def test_a_flag_contradicting_the_launcher_is_refused(monkeypatch, gpus):
    gpus(1)
    monkeypatch.setenv("PIPETRAIN_DEVICE", "cuda")
    with pytest.raises(ConfigError, match="--device cpu contradicts PIPETRAIN_DEVICE=cuda"):
        resolve_device("cpu")
    assert resolve_device("cuda") == "cuda"
    with pytest.raises(ConfigError, match="is not a device type"):
        resolve_device("tpu")


def test_more_local_ranks_than_gpus_is_refused_before_spawning(monkeypatch, gpus):
    monkeypatch.delenv("PIPETRAIN_DEVICE")
    gpus(1)
    check_local_ranks(1, "cuda")
    check_local_ranks(8, "cpu")
    with pytest.raises(ConfigError, match=r"runs 2 ranks on this node but it has 1 GPU\(s\).*Duplicate GPU") as info:
        check_local_ranks(2, "cuda")
    assert "--device cpu" in info.value.hint
    for start in (lambda: spawn(_never, ranks=range(2), world_size=2, master_addr="127.0.0.1", master_port=1,
                                device="cuda"),
                  lambda: launch_local(_never, 2, device="cuda"),  # examples/quickstart.py's launcher
                  lambda: calibrate({"seq_len": 8, "emsize": 8, "nhead": 2, "nhid": 8, "dropout": 0.0},
                                    device="cuda")):
        with pytest.raises(ConfigError, match="2 ranks on this node but it has 1 GPU"):
            start()
    # the bench: a cell of more ranks than GPUs is an "invalid" cell of the table, not a crash
    result = run_cell(Cell(pp=2, dp=1, batch_size=8, chunks=2, schedule="gpipe", checkpoint="never", preset="tiny"),
                      warmup=0, steps=1, timeout_s=5, device="cuda")
    assert (result.status, result.reason) == ("invalid", "dp*pp = 2 ranks but only 1 available")


def test_torchrun_ranks_are_counted_against_the_gpus(monkeypatch, gpus):
    from argparse import Namespace

    from pipetrain.cli.device_args import device_choice

    gpus(1)
    env = ClusterEnv(rank=0, world_size=2, local_rank=0, local_world_size=2, node_rank=0, num_nodes=1,
                     master_addr="127.0.0.1", master_port=1, source="torchrun")
    monkeypatch.delenv("PIPETRAIN_DEVICE")
    with pytest.raises(ConfigError, match=r"torchrun \(LOCAL_WORLD_SIZE=2\) runs 2 ranks .* 1 GPU"):
        device_choice(Namespace(device=None), env)
    assert device_choice(Namespace(device="cpu"), env) == "cpu"
    slurm = ClusterEnv(**{**env.__dict__, "source": "slurm"})  # srun may bind one GPU to each task: not counted
    assert device_choice(Namespace(device=None), slurm) == "cuda"


def test_train_cli_errors(cli, monkeypatch, gpus):
    gpus(1)
    assert_one_error(*cli(["train", "--device", "cuda", "--data", "synthetic", "--preset", "tiny"])[:3],
                     "--device cuda contradicts PIPETRAIN_DEVICE=cpu")
    monkeypatch.delenv("PIPETRAIN_DEVICE")
    gpus(0)
    assert_one_error(*cli(["train", "--device", "cuda", "--data", "synthetic", "--preset", "tiny"])[:3],
                     "--device cuda but", "--device cpu")
    gpus(1)
    assert_one_error(*cli(["train", "--device", "cuda", "--data", "synthetic", "--preset", "tiny"])[:3],
                     "runs 2 ranks on this node but it has 1 GPU(s)", "lower --pp/--dp")


def test_sbatch_renders_the_device():
    cpu = render_sbatch(SbatchRequest(command=["pipetrain", "train"], pp=2, tasks_per_node=2))
    assert "export PIPETRAIN_DEVICE=cpu" in cpu
    gpu = render_sbatch(SbatchRequest(command=["pipetrain", "train"], pp=2, gpus_per_node=2, tasks_per_node=2))
    assert "export PIPETRAIN_DEVICE=cuda" in gpu
    pinned = render_sbatch(SbatchRequest(command=["pipetrain", "train"], pp=2, gpus_per_node=2, tasks_per_node=2,
                                         device="cpu"))
    assert "export PIPETRAIN_DEVICE=cpu" in pinned
    with pytest.raises(ConfigError, match="--device cuda but the job asks for no GPU"):
        SbatchRequest(command=["pipetrain", "train"], device="cuda")
    with pytest.raises(ConfigError, match="sets --device cpu but the job runs on cuda"):
        SbatchRequest(command=["pipetrain", "train", "--device", "cpu"], gpus_per_node=1, tasks_per_node=1)

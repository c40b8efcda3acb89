"""Tensor parallelism without processes: the config, the mesh arithmetic, the plans' refusals (one message each),
tp across nodes, the `--tp` flags, and the private torch name the fused-projection style relies on."""

from __future__ import annotations

from dataclasses import replace

import pytest
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from pipetrain.cli.main import build_parser
from pipetrain.cli.parallel_args import parallel_config
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.errors import ConfigError
from pipetrain.launch.sbatch import SbatchRequest, render_sbatch
from pipetrain.parallel.tensor import block_plans, check_tensor_parallel
from pipetrain.parallel.tensor_styles import PRIVATE_DTENSOR, FusedColwiseParallel, HeadParallelAttention
from pipetrain.workloads.gpt import GPT_PRESETS, GPTModel
from pipetrain.workloads.transformer import PRESETS, TransformerClassifier
from tests.distributed.harness import PositionTableModel

TRAIN = ["/opt/venv/bin/python", "-m", "pipetrain", "train", "--preset", "tiny"]


def test_world_is_dp_pp_tp_and_the_old_calls_still_work():
    assert ParallelConfig().world_size == 1 and ParallelConfig().tp == 1
    assert ParallelConfig(dp=2, pipeline=PipelineConfig(pp=3)).world_size == 6
    assert ParallelConfig(dp=2, dp_mode="fsdp", tp=2, pipeline=PipelineConfig(pp=2)).world_size == 8
    with pytest.raises(ConfigError, match=r"dp=1 x pp=2 x tp=2 = 4 ranks, but the job has 8") as info:
        ParallelConfig(tp=2, pipeline=PipelineConfig(pp=2)).check_world(8)
    assert "dp * pp * tp = 8" in info.value.hint


@pytest.mark.parametrize("fields, message", [
    ({"tp": 0}, "tp must be a positive integer"),
    ({"sequence_parallel": True}, "but tp=1"),
    ({"tp": 2, "dp": 2}, "needs --dp-mode fsdp"),
])
def test_config_refusals(fields, message):
    with pytest.raises(ConfigError, match=message) as info:
        ParallelConfig(**fields)
    assert info.value.hint


def test_a_tp_group_across_nodes_is_refused():
    ParallelConfig(tp=4).check_nodes(8)
    ParallelConfig(tp=1).check_nodes(3)
    with pytest.raises(ConfigError, match="tp=4 does not divide the 6 ranks per node") as info:
        ParallelConfig(tp=4).check_nodes(6)
    assert "span two nodes" in str(info.value)
    with pytest.raises(ConfigError, match="span two nodes"):
        SbatchRequest(command=TRAIN, nodes=2, tasks_per_node=2, tp=4, pp=1)


def test_sbatch_appends_tp():
    script = render_sbatch(SbatchRequest(command=TRAIN, nodes=2, tasks_per_node=4, tp=2, pp=2, dp=2))
    assert "--tp 2" in script and "x tp=2 = 8 ranks" in script


def test_plans_of_the_built_in_models():
    gpt = block_plans(GPTModel(GPT_PRESETS["tiny"]), 2)
    assert gpt[0] is None and gpt[-1] is None  # embedding and head kept whole
    assert isinstance(gpt[1]["qkv"], FusedColwiseParallel) and isinstance(gpt[1]["proj"], RowwiseParallel)
    assert isinstance(gpt[1]["mlp.0"], ColwiseParallel) and isinstance(gpt[1]["mlp.2"], RowwiseParallel)
    classifier = block_plans(TransformerClassifier(PRESETS["tiny"]), 2)
    assert isinstance(classifier[2]["self_attn"], HeadParallelAttention) and classifier[0] is None


@pytest.mark.parametrize("model, tp, sp, message", [
    (TransformerClassifier(PRESETS["tiny"]), 4, False, "tp=4 does not divide the 2 attention heads"),
    (TransformerClassifier(replace(PRESETS["tiny"], nhead=4, nhid=66)), 4, False, "66 feed-forward units"),
    (GPTModel(replace(GPT_PRESETS["tiny"], nhead=4, emsize=32, mlp_ratio=1)), 3, False, "4 attention heads"),
    (GPTModel(GPT_PRESETS["tiny"]), 2, True, "--sequence-parallel is not available"),
    (PositionTableModel(), 2, False, "has no tensor-parallel plan"),
])
def test_plan_refusals(model, tp, sp, message):
    with pytest.raises(ConfigError, match=message) as info:
        check_tensor_parallel(model, tp, sequence_parallel=sp)
    assert info.value.hint


def test_tp1_needs_no_plan():
    check_tensor_parallel(PositionTableModel(), 1)


def test_tp_flags():
    args = build_parser().parse_args(["train", "--tp", "2", "--pp", "1", "--dp", "2", "--dp-mode", "fsdp"])
    parallel = parallel_config(args)
    assert (parallel.tp, parallel.sequence_parallel, parallel.world_size) == (2, False, 4)
    assert "x tp=2" in parallel.mesh_text


def test_private_dtensor_names_exist():
    import torch.distributed.tensor.placement_types as placements

    for name in PRIVATE_DTENSOR:
        assert hasattr(placements, name), f"torch moved {name}: update pipetrain/parallel/tensor_styles.py"

"""Tensor parallelism without processes: the config, the mesh arithmetic, the plans (with sequence parallelism and
the vocabulary-parallel head) and their refusals (one message each), the stage shapes of sequence shards, tp
across nodes, the `--tp` flags, and the private torch name the fused-projection style relies on."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel)

from pipetrain.cli.main import build_parser
from pipetrain.cli.parallel_args import parallel_config
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.errors import ConfigError
from pipetrain.launch.sbatch import SbatchRequest, render_sbatch
from pipetrain.parallel.tensor import block_plans, check_tensor_parallel
from pipetrain.compat.tensor_styles import FusedColwiseParallel, HeadParallelAttention
from pipetrain.pipeline.shapes import boundary_tensors, meta_blocks
from pipetrain.workloads.lm.gpt import GPT_PRESETS, GPTModel
from pipetrain.workloads.classifier.model import PRESETS, TransformerClassifier
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
    ({"loss_parallel": True}, "--loss-parallel splits the head over the tensor-parallel ranks, but tp=1"),
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


@pytest.mark.parametrize("model", [GPTModel(GPT_PRESETS["tiny"]), TransformerClassifier(PRESETS["tiny"])])
def test_sequence_parallel_plans(model):
    plans = block_plans(model, 2, sequence_parallel=True)
    assert isinstance(plans[0]["dropout"], PrepareModuleOutput)  # the embedding's output cut to the shard
    assert plans[0]["dropout"].desired_output_layouts == (Shard(1),)
    assert isinstance(plans[-1]["norm"], PrepareModuleInput)  # the head's input gathered back
    layer = plans[1]
    assert isinstance(layer["norm1"], SequenceParallel) and isinstance(layer["norm2"], SequenceParallel)
    linear1, linear2 = ("mlp.0", "mlp.2") if isinstance(model, GPTModel) else ("linear1", "linear2")
    assert layer[linear1].input_layouts == (Shard(1),) and layer[linear2].output_layouts == (Shard(1),)


def test_vocabulary_parallel_head():
    plans = block_plans(GPTModel(GPT_PRESETS["tiny"]), 2, loss_parallel=True)
    head = plans[-1]["linear"]
    assert isinstance(head, ColwiseParallel) and not head.use_local_output and head.output_layouts == (Shard(-1),)
    assert set(plans[-1]) == {"linear"} and plans[0] is None  # no sequence parallelism: no gather
    assert set(block_plans(GPTModel(GPT_PRESETS["tiny"]), 2, sequence_parallel=True, loss_parallel=True)[-1]) == {
        "norm", "linear"}


def test_stages_exchange_sequence_shards():
    model = GPTModel(GPT_PRESETS["tiny"])  # 6 blocks: embedding, 4 layers, head
    tokens = model.example_input(3)
    whole = boundary_tensors(meta_blocks(model), [(0, 2), (2, 4), (4, 6)], tokens, train=True)
    split = boundary_tensors(meta_blocks(model), [(0, 2), (2, 4), (4, 6)], tokens, train=True, sequence_shards=2)
    assert split[0][0].shape == whole[0][0].shape == (3, 32)  # the token ids in, whole
    assert split[-1][0].shape == whole[-1][0].shape == (3, 32, 96)  # the logits out, whole
    for inner in split[1:-1]:
        hidden, mask = inner
        assert hidden.shape == (3, 16, 32) and hidden.requires_grad  # this rank's half of the sequence
        assert mask.shape == (3, 32) and mask.dtype == torch.bool  # the padding mask crosses whole
    with pytest.raises(ConfigError, match="sequence length 30 is not divisible by 4") as info:  # e.g. a --bucket
        boundary_tensors(meta_blocks(model), [(0, 3), (3, 6)], tokens[:, :30], train=True, sequence_shards=4)
    assert "--bucket" in info.value.hint


class _OldHookGPT(GPTModel):
    """A plan hook written before the vocabulary-parallel head (no `loss_parallel` keyword)."""

    def tp_plan(self, index, tp, *, sequence_parallel=False):
        return super().tp_plan(index, tp, sequence_parallel=sequence_parallel)


class _TiedGPT(GPTModel):
    def tied_parameters(self):
        return [((0, "tokens.weight"), (self.num_blocks - 1, "linear.weight"))]


@pytest.mark.parametrize("model, tp, sp, message", [
    (TransformerClassifier(PRESETS["tiny"]), 4, False, "tp=4 does not divide the 2 attention heads"),
    (TransformerClassifier(replace(PRESETS["tiny"], nhead=4, nhid=66)), 4, False, "66 feed-forward units"),
    (GPTModel(replace(GPT_PRESETS["tiny"], nhead=4, emsize=32, mlp_ratio=1)), 3, False, "4 attention heads"),
    (GPTModel(replace(GPT_PRESETS["tiny"], seq_len=33)), 2, True, "sequence length 33 is not divisible by 2"),
    (TransformerClassifier(replace(PRESETS["tiny"], seq_len=31)), 2, True, "sequence length 31 is not divisible"),
    (PositionTableModel(), 2, False, "has no tensor-parallel plan"),
])
def test_plan_refusals(model, tp, sp, message):
    with pytest.raises(ConfigError, match=message) as info:
        check_tensor_parallel(model, tp, sequence_parallel=sp)
    assert info.value.hint


@pytest.mark.parametrize("model, message", [
    (GPTModel(replace(GPT_PRESETS["tiny"], vocab_size=97)), "tp=2 does not divide the 97 vocabulary entries"),
    (TransformerClassifier(PRESETS["tiny"]), "the classifier's head has 2 classes"),
    (_TiedGPT(GPT_PRESETS["tiny"]), "ties it to its embedding"),
    (_OldHookGPT(GPT_PRESETS["tiny"]), "has no vocabulary-parallel head"),
])
def test_loss_parallel_refusals(model, message):
    with pytest.raises(ConfigError, match=message) as info:
        check_tensor_parallel(model, 2, loss_parallel=True)
    assert info.value.hint
    check_tensor_parallel(model, 2)  # without --loss-parallel each of them splits


def test_tp1_needs_no_plan():
    check_tensor_parallel(PositionTableModel(), 1)


def test_tp_flags():
    args = build_parser().parse_args(["train", "--tp", "2", "--pp", "1", "--dp", "2", "--dp-mode", "fsdp"])
    parallel = parallel_config(args)
    assert (parallel.tp, parallel.sequence_parallel, parallel.world_size) == (2, False, 4)
    assert "x tp=2" in parallel.mesh_text
    args = build_parser().parse_args(["train", "--tp", "2", "--sequence-parallel", "--loss-parallel"])
    parallel = parallel_config(args)
    assert parallel.sequence_parallel and parallel.loss_parallel and "(sequence-parallel)" in parallel.mesh_text

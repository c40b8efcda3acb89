"""`--compile` as configuration: refused with the split-backward schedules, dynamic shapes for bucketed batches."""

from __future__ import annotations

import argparse

import pytest

from pipetrain.cli.parallel_args import add_parallel_arguments, parallel_config
from pipetrain.config import SPLIT_BACKWARD_SCHEDULES, ParallelConfig, PipelineConfig
from pipetrain.errors import ConfigError
from pipetrain.pipeline.compiled import dynamic_shapes
from pipetrain.train.loop import TrainConfig

pytestmark = pytest.mark.bf16  # the compiled-stage tier (docs/testing.md)


@pytest.mark.parametrize("schedule", SPLIT_BACKWARD_SCHEDULES)
def test_split_backward_schedules_refuse_compiled_blocks(schedule):
    with pytest.raises(ConfigError, match=f"--compile with schedule '{schedule}'.*161904") as err:
        PipelineConfig(pp=2, schedule=schedule, n_microbatches=4, compile=True)
    assert "drop --compile" in err.value.hint


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b"])
def test_other_schedules_compile(schedule):
    assert PipelineConfig(pp=2, schedule=schedule, n_microbatches=4, compile=True).compile


def test_flag_reaches_the_pipeline_config():
    parser = argparse.ArgumentParser()
    add_parallel_arguments(parser)
    assert parallel_config(parser.parse_args(["--compile"])).pipeline.compile
    assert not parallel_config(parser.parse_args([])).pipeline.compile


def test_dynamic_shapes_keeps_an_explicit_choice():
    chosen = ParallelConfig(pipeline=PipelineConfig(compile=True, compile_dynamic=False))
    assert dynamic_shapes(chosen) is chosen
    assert dynamic_shapes(ParallelConfig(pipeline=PipelineConfig(compile=True))).pipeline.compile_dynamic is True


@pytest.mark.parametrize("bucket, dynamic", [(True, True), (False, None)])
def test_bucketed_batches_compile_with_symbolic_shapes(bucket, dynamic):
    parallel = ParallelConfig(pipeline=PipelineConfig(pp=2, schedule="1f1b", n_microbatches=2, compile=True))
    config = TrainConfig(parallel=parallel, preset="tiny", data="synthetic", bucket=bucket)
    assert config.parallel.pipeline.compile_dynamic is dynamic

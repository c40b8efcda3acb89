"""`--sample-every` without processes: its flags' checks, the workloads it needs, and where a sample is shown."""

from __future__ import annotations

import logging

import pytest

from pipetrain.errors import ConfigError
from pipetrain.logs.config import LogConfig
from pipetrain.logs.meter import StepMeter
from pipetrain.logs.runlog import RunLog
from pipetrain.train.config import TrainConfig


def test_sample_every_and_prompt_go_together():
    with pytest.raises(ConfigError, match="--sample-every needs --sample-prompt TEXT"):
        LogConfig(sample_every=5)
    with pytest.raises(ConfigError, match="--sample-prompt needs --sample-every N"):
        LogConfig(sample_prompt="Hi")
    with pytest.raises(ConfigError, match="--sample-every must be 1 or more"):
        LogConfig(sample_every=0, sample_prompt="Hi")
    assert LogConfig(sample_every=5, sample_prompt="Hi").sample_tokens == 32


@pytest.mark.parametrize("workload", ["classifier", "hf"])
def test_sample_every_needs_a_model_folder(workload):
    with pytest.raises(ConfigError, match="--sample-every generates text with a model folder's tokenizer") as err:
        TrainConfig(workload=workload, preset="tiny" if workload == "classifier" else "llama-tiny", data="synthetic",
                    logs=LogConfig(sample_every=2, sample_prompt="Hi"))
    assert "--workload hf --model DIR" in err.value.hint


class _TextSink:
    def __init__(self) -> None:
        self.samples = []

    def step(self, record) -> None: ...

    def eval(self, record) -> None: ...

    def sample(self, step: int, prompt: str, text: str) -> None:
        self.samples.append((step, prompt, text))

    def close(self) -> None: ...


def test_a_sample_reaches_the_console_and_the_text_sinks_on_rank_0_only(caplog):
    main, other = (RunLog(LogConfig(), StepMeter.__new__(StepMeter), main=flag) for flag in (True, False))
    sink = _TextSink()
    main.sinks.append(sink)
    other.sinks.append(_TextSink())
    with caplog.at_level(logging.INFO, logger="pipetrain"):
        main.sample(4, "The cat", " sat on the mat")
        other.sample(4, "The cat", " sat on the mat")
    assert sink.samples == [(4, "The cat", " sat on the mat")] and other.sinks[0].samples == []
    assert caplog.text.count("sample at step 4: The cat -> ' sat on the mat'") == 1

"""The last stage returns its full-batch outputs only when asked (`keep_outputs`), and reads its metrics back to the
host once per step (on CUDA each read is a synchronisation): one in-process rank (gloo)."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

from pipetrain.errors import ConfigError
from pipetrain.pipeline import IGNORE_INDEX, TokenCrossEntropy

from pipetrain.blocks import ModuleListModel
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.launch.env import free_port
from pipetrain.launch.ranks import RankSpec
from pipetrain.session import close_session, open_session


def test_outputs_only_when_asked():
    model = ModuleListModel([nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)], example_input=torch.zeros(1, 4))
    session = open_session(RankSpec(0, 0, 1, "127.0.0.1", free_port(), "cpu"), model,
                           ParallelConfig(pipeline=PipelineConfig(pp=1, schedule="gpipe", n_microbatches=2)))
    try:
        x, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
        kept = session.engine.step(x, y)
        assert kept.outputs is not None and kept.outputs.shape == (6, 3)  # the public default: kept
        session.engine.keep_outputs = False
        dropped = session.engine.step(x, y)
        assert dropped.outputs is None and dropped.count == 6 and dropped.accuracy is not None
    finally:
        close_session()


#: The tensor methods that copy a value to the host (a CUDA synchronisation each).
_HOST_READS = ("item", "tolist", "__int__", "__float__", "__bool__")


def test_a_token_loss_step_reads_the_device_once(monkeypatch):
    model = ModuleListModel([nn.Embedding(10, 8), nn.Linear(8, 10)], example_input=torch.zeros(1, 5, dtype=torch.long))
    session = open_session(RankSpec(0, 0, 1, "127.0.0.1", free_port(), "cpu"), model,
                           ParallelConfig(pipeline=PipelineConfig(pp=1, schedule="gpipe", n_microbatches=2)),
                           loss_fn=TokenCrossEntropy())
    try:
        x, y = torch.randint(1, 10, (4, 5)), torch.randint(0, 10, (4, 5))
        y[0, 3:] = IGNORE_INDEX
        session.engine.step(x, y)  # the first step builds the schedule
        reads: collections.Counter = collections.Counter()
        with monkeypatch.context() as patched:
            for name in _HOST_READS:
                original = getattr(torch.Tensor, name)

                def counted(self, *args, _name=name, _original=original, **kwargs):
                    reads[_name] += 1
                    return _original(self, *args, **kwargs)

                patched.setattr(torch.Tensor, name, counted)
            result = session.engine.step(x, y)
        assert dict(reads) == {"tolist": 1}  # was 3 int() + 2 item() + 1 tolist()
        assert result.count == 18 and result.perplexity is not None
        with pytest.raises(ConfigError, match="every target of this batch is padding"):
            session.engine.step(x, torch.full_like(y, IGNORE_INDEX))
    finally:
        close_session()

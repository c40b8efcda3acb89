"""The last stage returns its full-batch outputs only when asked (`keep_outputs`): one in-process rank (gloo)."""

from __future__ import annotations

import torch
from torch import nn

from pipetrain.blocks import ModuleListModel
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.launch.env import free_port
from pipetrain.launch.spawn import RankSpec
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

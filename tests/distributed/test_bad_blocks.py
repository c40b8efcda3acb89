"""A block whose output cannot cross a pipeline stage: one clear error from a 2-rank job, before any step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipetrain import ModuleListModel, ParallelConfig, PipelineConfig, RankFailedError
from pipetrain.launch.spawn import RankSpec, launch_local
from pipetrain.session import close_session, open_session


class _Scalar(nn.Module):
    """Returns its input and a Python float: the float cannot be sent to the next stage."""

    def forward(self, x: torch.Tensor):
        return x, float(x.shape[1])


def _train(spec: RankSpec) -> None:
    model = ModuleListModel([nn.Linear(4, 4), _Scalar(), nn.Linear(4, 2)], example_input=torch.zeros(1, 4))
    layout = ParallelConfig(pipeline=PipelineConfig(pp=2, n_microbatches=2))
    try:
        open_session(spec, model, layout)
    finally:
        close_session()


def test_a_block_returning_a_python_number_is_one_clear_error():
    with pytest.raises(RankFailedError) as err:
        launch_local(_train, 2, timeout_s=120)
    message = str(err.value)
    assert message.startswith("block 1 (_Scalar) returned a float (4.0), which cannot cross a pipeline stage")
    assert "hint: make every block return a tensor or a tuple of tensors" in message
    assert "Traceback" not in message and message.count("cannot cross") == 1

"""Old names of the public API keep working for a release, with a DeprecationWarning (one spawned rank)."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from pipetrain.blocks import ModuleListModel
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.launch.env import free_port
from pipetrain.launch.spawn import RankSpec, spawn
from pipetrain.session import build_session, close_session, join_job


def _grads(session, x, y, **count) -> tuple[list[torch.Tensor], list[warnings.WarningMessage]]:
    for param in session.engine.parameters():
        param.grad = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        session.engine.step(x, y, **count)
    return [p.grad.clone() for p in session.engine.parameters()], caught


def _worker(spec: RankSpec) -> None:
    device = join_job(spec)
    try:
        torch.manual_seed(0)
        model = ModuleListModel([nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)], example_input=torch.zeros(1, 4))
        session = build_session(model, ParallelConfig(pipeline=PipelineConfig(pp=1, n_microbatches=2)), device)
        x, y = torch.randn(6, 4), torch.tensor([0, 1, 1, 0, 1, 0])
        new, quiet = _grads(session, x, y, global_count=12)
        old, warned = _grads(session, x, y, global_batch_size=12)
        assert not [w for w in quiet if issubclass(w.category, DeprecationWarning)]
        messages = [str(w.message) for w in warned if issubclass(w.category, DeprecationWarning)]
        assert len(messages) == 1 and "global_count" in messages[0], messages
        assert all(torch.equal(a, b) for a, b in zip(new, old))
        default, _ = _grads(session, x, y)  # 6 samples: twice the gradient of a batch counted as 12
        assert all(torch.allclose(a, 2 * b) for a, b in zip(default, new))
    finally:
        close_session()


def test_step_global_batch_size_is_the_deprecated_name_of_global_count() -> None:
    spawn(_worker, ranks=range(1), world_size=1, master_addr="127.0.0.1", master_port=free_port())

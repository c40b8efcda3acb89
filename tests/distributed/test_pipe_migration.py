"""The `Pipe` tutorial's loop migrated to pipetrain (examples/pipe_tutorial.py) trains, and equals the unsplit loop.

The example runs under torchrun on 2 ranks (a stage each, 4 micro-batches, recomputation as the old Pipe's
default). The reference is the same script in this process with a plain stand-in for `Pipe` (the unsplit
`nn.Sequential`, plain autograd and `torch.nn.utils.clip_grad_norm_`). Every step's loss (printed with 6
decimals), and the loss of a final forward-only pass (`model.eval()`, `torch.no_grad()`), agree within the fp32
parity tolerance (rtol 1e-5, atol 4e-5); and the loss goes down.
"""

from __future__ import annotations

import re
import runpy
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from pipetrain.launch.env import free_port

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pipe_tutorial.py"
LOSS = re.compile(r"\| (?:batch +\d+|eval) +\| loss (\d+\.\d+)")  # 6 training steps, then one evaluation
RANK_LOSS = re.compile(r"\[default(\d)\]:\| (?:batch +\d+|eval) +\| loss (\d+\.\d+)")  # torchrun --tee prefix


class PlainPipe(nn.Module):
    """What the old single-process Pipe computed: the whole `nn.Sequential` on one device."""

    def __init__(self, module: nn.Sequential, chunks: int = 1, checkpoint: str = "except_last") -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> types.SimpleNamespace:
        out = self.module(x).contiguous()  # the old Pipe concatenated the micro-batch outputs
        return types.SimpleNamespace(local_value=lambda: out)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm)


def test_migrated_tutorial_trains_and_matches_the_unsplit_loop(monkeypatch, capsys):
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         "--tee", "3", str(EXAMPLE)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    pipelined: dict[str, list[float]] = {"0": [], "1": []}
    for rank, loss in RANK_LOSS.findall(run.stdout):
        pipelined[rank].append(float(loss))

    monkeypatch.setitem(sys.modules, "pipetrain", types.SimpleNamespace(Pipe=PlainPipe))
    with torch.random.fork_rng(devices=[]):
        runpy.run_path(str(EXAMPLE), run_name="__main__")
    reference = [float(x) for x in LOSS.findall(capsys.readouterr().out)]
    assert len(reference) == 7

    for rank, losses in pipelined.items():  # every rank prints the loss of the whole batch
        assert losses == pytest.approx(reference, rel=1e-5, abs=4e-5), f"rank {rank}: {losses} vs {reference}"
    assert reference[5] < 0.7 * reference[0], f"the loop did not train: {reference}"

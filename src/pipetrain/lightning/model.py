"""The model a LightningModule trains under `PipelineStrategy`: this rank's stages, called like the whole model.

In `configure_model`, a LightningModule writes `self.model = pipeline(self, MyBlocks())` with any `BlockModel`.
Under `PipelineStrategy` that is a `PipelinedModel` holding only this rank's blocks; under any other strategy (one
process, DDP, ...) it is the whole model, `pipetrain.build_sequential(blocks)`, initialised with the same weights
(each block under its own seed), so the same LightningModule trains either way.

`training_step` keeps its usual lines: `output = self.model(x)` is a deferred output, and the loss function applied
to it (`F.cross_entropy(output, y)`, any mean-reducing torch loss, after `view`/`reshape`/`flatten`...) runs the
pipelined step there: the forward and backward of every micro-batch on every stage, the loss computed at the last
stage. It returns the loss of the whole batch as a tensor, the same on every rank, for `self.log` and for Lightning,
whose backward then hands over the gradients the step already computed (see `PipelineStrategy.backward`). Under
`torch.no_grad()` or in eval mode (validation) the step is forward-only. `model.last` holds the step's
`StepResult` (loss, accuracy of class logits, and the outputs on the last stage).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pipetrain.blocks import BlockModel, Tensors, build_sequential
from pipetrain.errors import ConfigError
from pipetrain.pipe import PipeOutput, run_batch
from pipetrain.pipeline import PipelineEngine, StepResult

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["PipelinedModel", "pipeline"]


def pipeline(module: pl.LightningModule, blocks: BlockModel, *, seed: int = 0) -> nn.Module:
    """The model `module` trains: this rank's stages of `blocks` under `PipelineStrategy`, else the whole model.

    Call it in `configure_model` (`self.model = pipeline(self, MyBlocks())`); `seed` initialises block `i` under
    `pipetrain.block_seed(seed, i)` in both cases."""
    if not isinstance(blocks, BlockModel):
        raise ConfigError(f"pipeline() got {type(blocks).__name__}, not a BlockModel",
                          hint="pass an object with num_blocks, build_block(i) and example_input(batch_size), "
                               "e.g. pipetrain.ModuleListModel([...]) (see docs/lightning.md)")
    strategy = _strategy(module)
    build = getattr(strategy, "build_pipeline", None)
    if build is None:
        return build_sequential(blocks, seed=seed)
    return build(blocks, seed=seed)


def _strategy(module: pl.LightningModule) -> object | None:
    trainer = getattr(module, "_trainer", None)
    return None if trainer is None else trainer.strategy


class PipelinedModel(nn.Module):
    """This rank's stages of a `BlockModel` (`stages`: the engine's modules); calling it defers to the loss."""

    def __init__(self, engine: PipelineEngine, device: torch.device) -> None:
        super().__init__()
        self.engine = engine
        self.device = device
        self.stages = nn.ModuleList(engine.modules)  # this rank's parameters, for configure_optimizers
        #: the last step's metrics (the same on every rank)
        self.last: StepResult | None = None
        self._fresh: list[tuple[nn.Parameter, torch.Tensor]] = []

    def forward(self, *inputs: torch.Tensor) -> PipeOutput:
        if not inputs:
            raise TypeError("the pipelined model takes the first block's input(s)")
        return _Deferred(self, inputs if len(inputs) > 1 else inputs[0], [])

    def train(self, mode: bool = True) -> PipelinedModel:
        super().train(mode)
        self.engine.train(mode)
        return self

    def _run(self, inputs: Tensors, targets: torch.Tensor, loss_fn: Callable, train: bool) -> StepResult:
        if not train:
            self.last = run_batch(self.engine, self.device, inputs, targets, loss_fn, train=False)
            return self.last
        # the step's own gradients are kept aside until Lightning's backward (it zeroes the parameters' in between)
        params = list(self.engine.parameters())
        before = [p.grad for p in params]
        for param in params:
            param.grad = None
        try:
            self.last = run_batch(self.engine, self.device, inputs, targets, loss_fn, train=True)
            self._fresh = [(p, p.grad) for p in params if p.grad is not None]
        finally:
            for param, grad in zip(params, before):
                param.grad = grad
        return self.last

    def hand_over_grads(self, scale: float = 1.0) -> None:
        """Add the last training step's gradients, times `scale`, to the parameters' (Lightning's backward)."""
        for param, grad in self._fresh:
            grad = grad if scale == 1.0 else grad * scale
            param.grad = grad if param.grad is None else param.grad + grad
        self._fresh = []


class _Deferred(PipeOutput):
    """A `PipeOutput` whose loss runs at once: the loss function returns the batch's loss as a tensor."""

    @classmethod
    def __torch_function__(cls, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        loss = PipeOutput.__torch_function__.__func__(cls, func, types, args, kwargs)
        model: PipelinedModel = loss.output.pipe
        train = model.training and torch.is_grad_enabled()
        result = model._run(loss.output.inputs, loss.targets, loss.loss_fn, train)
        return torch.tensor(result.loss, dtype=torch.float32, device=model.device)

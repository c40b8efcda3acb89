"""`pipetrain.Pipe`: the removed `torch.distributed.pipeline.sync.Pipe`'s training loop, run on pipetrain's engine.

The old `Pipe` drove every GPU from one process: `output = model(x).local_value()`, a loss on `output`,
`loss.backward()`. pipetrain runs one process per stage (launch the unchanged script with `torchrun
--nproc-per-node N`, `srun`, or plainly for one process), and its schedules run the forward and the
backward of every micro-batch together, with the loss computed at the last stage. So `Pipe(...)(x)` returns
a deferred `PipeOutput`; a loss computed from it (any torch loss function or `nn` loss module, after
`view`/`reshape`/`flatten`/`float`) is a deferred `PipeLoss`; the pipelined step runs at `loss.backward()`
(or, under `torch.no_grad()` / `model.eval()`, a forward-only pass at `loss.item()`). Targets are split
into micro-batches with the inputs (their first dimension, or their flattened elements, in batch order),
so the loss equals the loss of the whole batch. Every rank runs the same script on the same batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.blocks import ModuleListModel, Tensors, as_tuple
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.launch.env import detect, free_port
from pipetrain.launch.ranks import RankSpec
from pipetrain.parallel import pick_device
from pipetrain.partition import balance_bounds, resolve_balance
from pipetrain.pipeline import PipelineEngine, StepResult
from pipetrain.pipeline.loss import SampleMeanLoss
from pipetrain.recipe.clip import clip_grad_norm_
from pipetrain.session import build_session, join_job

__all__ = ["Pipe", "PipeOutput", "PipeLoss", "free_other_stages", "run_batch"]

_SHAPE_METHODS = ("view", "reshape", "flatten", "float", "contiguous", "squeeze", "transpose", "permute")


class _Children(ModuleListModel):
    """The `nn.Sequential`'s children as blocks. This rank's own blocks are the user's modules themselves (so the
    optimizer, made before the first batch, holds the parameters the engine trains); other blocks, and every
    block built on the meta device (shape inference), are copies. The example input is the first batch."""

    def __init__(self, modules: list[nn.Module], local: dict[int, nn.Module]) -> None:
        super().__init__(modules, example_input=torch.empty(0))
        self.local = local

    def build_block(self, index: int) -> nn.Module:
        if index in self.local and torch.get_default_device().type != "meta":
            return self.local[index]
        return super().build_block(index)

    def set_example(self, batch: torch.Tensor) -> None:
        self._example = batch[:1].detach().cpu()


class Pipe(nn.Module):
    """Pipeline `module`'s children over the job's ranks (one stage per rank), `chunks` micro-batches per batch.

    `checkpoint`: activation recomputation, as the old Pipe ("except_last" by default, "always", "never").
    `schedule`: "gpipe" (the old Pipe's, default) or "1f1b". The children are the blocks: as many children as
    ranks gives one child per stage (the old Pipe's layout); otherwise `balance` (blocks per stage) or an
    even split. Each rank keeps only its stage; `parameters()` are this rank's (give them to the optimizer).
    """

    def __init__(self, module: nn.Sequential, chunks: int = 1, checkpoint: str = "except_last", *,
                 schedule: str = "gpipe", balance: list[int] | None = None, seed: int = 0) -> None:
        super().__init__()
        if not dist.is_initialized():
            env = detect()
            spec = (RankSpec(0, 0, 1, "127.0.0.1", free_port()) if env is None
                    else RankSpec(env.rank, env.local_rank, env.world_size, env.master_addr, env.master_port))
            join_job(spec)
        pp = dist.get_world_size()
        self.config = PipelineConfig(pp=pp, schedule=schedule, n_microbatches=chunks, checkpoint=checkpoint,
                                     balance=tuple(balance) if balance else None)
        children = list(module.children())
        bounds = balance_bounds(resolve_balance(ModuleListModel(children, torch.empty(0)), self.config))
        mine = [i for stage in self.config.stage_ids(dist.get_rank()) for i in range(*bounds[stage])]
        self.device = _device()
        self.stages = nn.ModuleList([children[i].to(self.device) for i in mine])  # this rank's parameters
        free_other_stages(children, mine)
        self._model = _Children(children, dict(zip(mine, self.stages)))
        self._seed = seed
        self._engine: PipelineEngine | None = None  # built at the first batch, whose shapes it needs
        self.last: StepResult | None = None

    @property
    def engine(self) -> PipelineEngine:
        """The pipeline engine running this rank's stages (built at the first batch)."""
        if self._engine is None:
            session = build_session(self._model, ParallelConfig(pipeline=self.config), self.device, seed=self._seed)
            self._engine = session.engine
            self._engine.train(self.training)
        return self._engine

    def forward(self, inputs: torch.Tensor) -> PipeOutput:
        return PipeOutput(self, inputs, [])

    def train(self, mode: bool = True) -> Pipe:
        super().train(mode)
        if self._engine is not None:
            self._engine.train(mode)
        return self

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` over the whole pipeline: the global norm of every stage's gradients
        (returned as a tensor, as torch's), every gradient scaled by `min(1, max_norm / (norm + 1e-6))`."""
        return torch.tensor(clip_grad_norm_(self.engine, max_norm, norm_type))

    def _run(self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: Callable, train: bool) -> StepResult:
        if self._engine is None:
            self._model.set_example(inputs)  # what the engine checks the blocks with when it is built
        self.last = run_batch(self.engine, self.device, inputs, targets, loss_fn, train=train)
        return self.last


def run_batch(engine: PipelineEngine, device: torch.device, inputs: Tensors, targets: torch.Tensor,
              loss_fn: Callable, *, train: bool) -> StepResult:
    """One pipelined step of `engine` (forward and backward when `train`, else forward only) on a whole batch,
    the loss `loss_fn(output, target)` a mean-reducing function applied to each micro-batch's output and targets.
    Targets are cut into micro-batches with the inputs: by their first dimension when it is the batch's, else by
    their flattened elements in batch order (`loss_fn` then sees them in their original trailing shape)."""
    batch = as_tuple(inputs)[0].shape[0]
    samplewise = targets if targets.dim() > 0 and targets.shape[0] == batch else targets.reshape(batch, -1)

    def per_chunk(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_fn(output, target if samplewise is targets else target.reshape(-1, *targets.shape[1:]))

    engine.loss = SampleMeanLoss(per_chunk)
    moved = tuple(t.to(device) for t in as_tuple(inputs))
    moved_inputs = moved if isinstance(inputs, tuple) else moved[0]
    samplewise = samplewise.to(device)
    return engine.step(moved_inputs, samplewise) if train else engine.evaluate(moved_inputs, samplewise)


def free_other_stages(children: list[nn.Module], mine: list[int]) -> None:
    """Move the children of other ranks' stages to the meta device, in place: their weights (on the CPU, or on the
    GPUs the script's `.cuda(i)` put them) are freed; only their shapes are still needed (shape inference)."""
    keep = set(mine)
    for index, child in enumerate(children):
        if index not in keep:
            child.to("meta")


def _device() -> torch.device:
    env = detect()
    return pick_device(env.local_rank if env is not None else 0)


class PipeOutput:
    """The deferred output of `Pipe(x)`: record shape methods, then hand it to a loss function."""

    def __init__(self, pipe: Pipe, inputs: torch.Tensor, ops: list[tuple[str, tuple, dict]]) -> None:
        self.pipe, self.inputs, self.ops = pipe, inputs, ops

    def local_value(self) -> PipeOutput:
        """The old Pipe returned an RRef; here the output is already local."""
        return self

    def __getattr__(self, name: str) -> Any:
        if name not in _SHAPE_METHODS:
            raise AttributeError(f"a Pipe output supports {', '.join(_SHAPE_METHODS)} before the loss, not {name!r}")
        return lambda *args, **kwargs: type(self)(self.pipe, self.inputs, [*self.ops, (name, args, kwargs)])

    def apply(self, output: torch.Tensor) -> torch.Tensor:
        """The recorded shape methods applied to a (micro-batch) output, made contiguous first as the old Pipe's
        output was (it concatenated the micro-batches' outputs), so that `view` works as it did."""
        output = output.contiguous()
        for name, args, kwargs in self.ops:
            output = getattr(output, name)(*args, **kwargs)
        return output

    @classmethod
    def __torch_function__(cls, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None) -> PipeLoss:
        kwargs = kwargs or {}
        position = next(i for i, a in enumerate(args) if isinstance(a, PipeOutput))
        out: PipeOutput = args[position]
        target_at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        if len(target_at) != 1:
            raise TypeError(f"{getattr(func, '__name__', func)} on a Pipe output needs exactly one target tensor")

        def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            call = list(args)
            call[position], call[target_at[0]] = out.apply(output), target
            return func(*call, **kwargs)

        return PipeLoss(out, args[target_at[0]], loss_fn)


class PipeLoss:
    """A loss over a `PipeOutput`; `backward()` runs the pipelined forward and backward of the batch."""

    def __init__(self, output: PipeOutput, targets: torch.Tensor, loss_fn: Callable) -> None:
        self.output, self.targets, self.loss_fn = output, targets, loss_fn
        self.result: StepResult | None = None

    def backward(self) -> None:
        if self.result is None:
            self.result = self.output.pipe._run(self.output.inputs, self.targets, self.loss_fn, train=True)

    def item(self) -> float:
        """The loss of the whole batch. Without a `backward()` before, it runs the step now: forward-only under
        `torch.no_grad()` or after `eval()`, else forward and backward (then `backward()` does nothing)."""
        if self.result is None:
            pipe = self.output.pipe
            train = pipe.training and torch.is_grad_enabled()
            self.result = pipe._run(self.output.inputs, self.targets, self.loss_fn, train=train)
        return self.result.loss

    def __float__(self) -> float:
        return self.item()

"""The single-process side of `pipetrain check`: dropout switched off, the reference run, and the hazard probes.

Dropout: random masks cannot agree between two layouts (each rank draws its own), so both sides run with every
dropout probability set to 0 (`nn.Dropout*` modules' `p`, and float attributes named like `*dropout*`, which
`nn.MultiheadAttention` and Hugging Face attention layers read), in training mode, so that everything else
(batch statistics included) behaves as in training. The probes then call each block on the input it got in the
reference's first step: twice under one RNG seed (hidden state), under another seed (randomness left), and on
the batch cut into micro-batches (batch statistics).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pipetrain.blocks import BlockModel, BlockSequential, as_tuple, build_sequential
from pipetrain.compat.modules import is_batch_norm, is_dropout
from pipetrain.check.compare import tensor_rel
from pipetrain.check.findings import Hazard
from pipetrain.pipeline.loss import as_loss
from pipetrain.pipeline.runs import plan_runs
from pipetrain.pipeline.precision import autocast

__all__ = ["QuietModel", "quiet", "reference_run", "probe_hazards", "static_hazards"]

#: relative difference of a probe's outputs that counts as "different" (the probes run in fp32)
PROBE_TOLERANCE = 1e-6


def quiet(module: nn.Module) -> list[str]:
    """Set every dropout probability inside `module` to 0; returns what was switched off (`name p=...`)."""
    switched = []
    for name, sub in module.named_modules():
        if is_dropout(sub) and sub.p > 0:
            switched.append(f"{name or type(sub).__name__} p={sub.p:g}")
            sub.p = 0.0
        for attr, value in list(vars(sub).items()):
            if "dropout" in attr and isinstance(value, float) and not isinstance(value, bool) and value > 0:
                switched.append(f"{name + '.' if name else ''}{attr}={value:g}")
                setattr(sub, attr, 0.0)
    return switched


class QuietModel:
    """`model` whose blocks are built with dropout switched off (see `quiet`); everything else is `model`'s."""

    def __init__(self, model: BlockModel) -> None:
        self.inner = model

    @property
    def num_blocks(self) -> int:
        return self.inner.num_blocks

    def build_block(self, index: int) -> nn.Module:
        block = self.inner.build_block(index)
        quiet(block)
        return block

    def example_input(self, batch_size: int):
        return self.inner.example_input(batch_size)

    def __getattr__(self, name: str) -> Any:  # other hooks a model may offer (e.g. its tied weights)
        return getattr(self.inner, name)


def _micro_batches(batch: int, replicas: int, chunks: int) -> list[slice]:
    """The micro-batches of a batch as the layout cuts it: equal contiguous replica shares, each cut by the
    engine's `plan_runs`."""
    share, out = batch // replicas, []
    for replica in range(replicas):
        at = replica * share
        for run in plan_runs(share, chunks):
            for _ in range(run.count):
                out.append(slice(at, at + run.size))
                at += run.size
    return out


def reference_run(model: BlockModel, batches: list, loss_fn: Callable, *, seed: int, lr: float, precision: str,
                  device: torch.device, split: tuple[int, int] = (1, 1)) -> dict:
    """The unsplit model in one process on the whole batches, SGD at `lr`: the ground truth of a check. A loss
    defined per micro-batch (it reads more than the logits: a mixture of experts' load-balancing loss) runs on the
    micro-batches the layout cuts, `split` = (replicas, micro-batches per replica), its totals over the batch's count."""
    net = build_sequential(QuietModel(model), seed=seed, device=device)
    loss = as_loss(loss_fn)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    losses, grads, params = [], [], []
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        target = y.to(device)
        count = loss.count(target)
        pieces = _micro_batches(target.shape[0], *split) if getattr(loss, "outputs", 1) > 1 else [slice(None)]
        value = 0.0
        for part in pieces:
            with autocast(device, precision):
                out = net(*(t[part].to(device) for t in as_tuple(x)))
            out = tuple(t.float() for t in out) if isinstance(out, tuple) else out.float()
            piece = loss.total(out, target[part]) / count
            piece.backward()
            value += piece.item()
        losses.append(value)
        named = list(net.named_parameters(remove_duplicate=False))  # every copy of a tied weight, by its name
        grads.append({n: None if p.grad is None else p.grad.detach().cpu().clone() for n, p in named})
        optimizer.step()
        params.append({n: p.detach().cpu().clone() for n, p in net.named_parameters(remove_duplicate=False)})
    return {"losses": losses, "grads": grads, "params": params}


def static_hazards(net: BlockSequential, switched: dict[int, list[str]], ref: dict, *,
                   ddp_replicas: bool = False) -> list[Hazard]:
    """What the model's structure and its reference run show: dropout switched off, BatchNorm layers, buffers
    outside the state dict, plain tensor attributes, parameters without gradient (a cause of failure under DDP
    replicas, `ddp_replicas`), tied weights."""
    found = []
    for block, names in sorted(switched.items()):
        found.append(Hazard("dropout", block, f"switched off for the comparison (p=0 on both sides): "
                                              f"{', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"))
    for index, block in enumerate(net):
        norms = [n for n, m in block.named_modules() if is_batch_norm(m)]
        if norms:
            found.append(Hazard("batch statistics", index, f"BatchNorm layer(s) {', '.join(norms)}: each "
                                "micro-batch is normalised by its own statistics (at --chunks 1, the batch's); the "
                                "running statistics move once per micro-batch, or once per step from the whole batch "
                                "with --deferred-batchnorm (docs/batchnorm.md)"))
        saved = set(block.state_dict())
        hidden = [n for n, _ in block.named_buffers() if n not in saved]
        if hidden:
            found.append(Hazard("buffer outside the state dict", index,
                                f"{', '.join(hidden)} (non-persistent): a checkpoint does not keep it"))
        for name, sub in block.named_modules():
            loose = [k for k, v in vars(sub).items() if isinstance(v, torch.Tensor)]
            if loose:
                where = ", ".join(f"{name + '.' if name else ''}{k}" for k in loose)
                found.append(Hazard("tensor outside parameters and buffers", index,
                                    f"{where}: not moved to the device, not saved, not synchronised"))
    unused = [n for n, g in ref["grads"][0].items() if g is None]
    for name in unused:
        found.append(Hazard("parameter never used", int(name.partition(".")[0]),
                            f"{name} gets no gradient in the reference"
                            + (": DDP replicas wait for its gradient (use --dp-mode fsdp, or drop the parameter)"
                               if ddp_replicas else ""), cause=ddp_replicas))
    found += _tied(net)
    return found


def _tied(net: BlockSequential) -> list[Hazard]:
    found = []
    seen: dict[int, str] = {}
    for name, param in net.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            found.append(Hazard("tied weights", int(name.partition(".")[0]),
                                f"{name} is the same tensor as {seen[id(param)]} (tied by the model: the layout "
                                "keeps its copies equal, gradients summed across stages)"))
        else:
            seen[id(param)] = name
    with torch.no_grad():  # separate tensors equal at initialisation: a tie the layout may not keep
        params = [(n, p) for n, p in net.named_parameters() if p.numel() > 1 and p.detach().std().item() > 0]
        for i, (name, param) in enumerate(params):
            for other, value in params[i + 1:]:
                if other.partition(".")[0] != name.partition(".")[0] and value.shape == param.shape \
                        and torch.equal(value, param):
                    found.append(Hazard("tied weights", int(other.partition(".")[0]),
                                        f"{other} equals {name} at initialisation: separate tensors that "
                                        "train apart unless their gradients are summed"))
    return found


def _outputs(block: nn.Module, inputs: tuple, seed: int) -> tuple[torch.Tensor, ...]:
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        return tuple(t.detach() for t in as_tuple(block(*inputs)))


def _differ(a: tuple, b: tuple) -> float:
    if len(a) != len(b):
        return float("inf")
    return max((tensor_rel(x.float(), y.float()) if x.is_floating_point() else float(not torch.equal(x, y))
                for x, y in zip(a, b)), default=0.0)


def probe_hazards(net: BlockSequential, x, micro: int) -> list[Hazard]:
    """Call each block on its input of the batch `x` (captured from `net`'s forward): twice, under another
    seed, and in micro-batches of `micro` samples (halves when that is the whole batch); each kind of
    difference is a hazard that can explain a FAIL."""
    captured: dict[int, tuple] = {}
    hooks = [block.register_forward_pre_hook(lambda _m, args, i=i: captured.setdefault(i, tuple(
        a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args))) for i, block in enumerate(net)]
    try:
        _outputs(copy.deepcopy(net), tuple(t.to(next(net.parameters()).device) for t in as_tuple(x)), seed=0)
    finally:
        for hook in hooks:
            hook.remove()
    found = []
    for index, block in enumerate(net):
        inputs = captured[index]
        batch = inputs[0].shape[0]
        size = micro if micro < batch else max(1, batch // 2)
        probe = copy.deepcopy(block)
        first, again = _outputs(probe, inputs, seed=1), _outputs(probe, inputs, seed=1)
        if (d := _differ(first, again)) > PROBE_TOLERANCE:
            found.append(Hazard("hidden state", index, f"two identical calls give outputs {d:.1e} apart (a "
                                "Python-side counter or cache?): each micro-batch and recomputation calls it "
                                "again", cause=True))
            continue
        if (d := _differ(first, _outputs(probe, inputs, seed=2))) > PROBE_TOLERANCE:
            found.append(Hazard("randomness", index, f"outputs change with the RNG seed ({d:.1e}) after dropout "
                                "was switched off: each rank draws its own numbers", cause=True))
            continue
        pieces = [_outputs(copy.deepcopy(block), tuple(t[s : s + size] if isinstance(t, torch.Tensor) else t
                                                       for t in inputs), seed=1) for s in range(0, batch, size)]
        joined = tuple(torch.cat(parts) for parts in zip(*pieces))
        if (d := _differ(first, joined)) > PROBE_TOLERANCE:
            found.append(Hazard("batch statistics", index, f"a sample's output depends on the other samples of "
                                f"its batch: in micro-batches of {size} it differs by {d:.1e}", cause=True))
    return found

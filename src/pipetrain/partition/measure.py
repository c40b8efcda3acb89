"""Measure a per-block profile of any `BlockModel` on the local device (no torch.distributed).

Each block is built on its own, fed the previous block's output for one micro-batch, and timed: forward
in training mode, then backward from a fixed random output gradient. Bytes saved for backward are
counted with `torch.autograd.graph.saved_tensors_hooks` (each storage once, parameters excluded), and what the
backward holds at once beyond them (`backward_bytes`: the gradients it makes before the saved tensors they
free; `compat/live.py`'s counter, each storage once). Given the
form a block takes under selective recomputation (`selective`: the caller's, the pipeline's own wrapper), one
more forward through it counts what that keeps, each storage once as well: the block's inputs (the checkpoint
holds them) and every storage its forward made that is still alive after it but its outputs (the policy's kept
products: no saved-tensor hook sees them, so the live-bytes counter of `compat/live.py` does).
On the CPU the clock is this process's CPU time (what the block costs, unaffected by other processes
taking the cores: a profile taken on a busy machine still balances well); on a GPU it is wall time
after synchronising the device.
"""

from __future__ import annotations

import gc
import statistics
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from pipetrain.blocks import BlockModel, build_blocks
from pipetrain.compat.live import LiveBytes
from pipetrain.errors import ConfigError
from pipetrain.partition.fit import fit_profiles
from pipetrain.partition.profile import BlockProfile, ModelProfile, fingerprint_of

__all__ = ["model_fingerprint", "profile_model", "profile_model_sizes", "default_sizes"]


def model_fingerprint(model: BlockModel) -> str:
    """The profile fingerprint of `model`: block classes and parameter names, shapes and dtypes (meta build)."""
    described = []
    for index in range(model.num_blocks):
        with torch.device("meta"):
            block = model.build_block(index)
        params = [(name, tuple(p.shape), str(p.dtype).removeprefix("torch.")) for name, p in block.named_parameters()]
        described.append((type(block).__name__, params))
        del block
    return fingerprint_of(described)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []


def _as_inputs(value: Any) -> tuple[Any, ...]:
    """The next block's call arguments: detached copies (floating tensors require grad), as a tuple."""

    def leaf(item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            fresh = item.detach().clone()
            return fresh.requires_grad_(fresh.is_floating_point())
        return item

    items = value if isinstance(value, tuple) else (value,)
    return tuple(leaf(item) for item in items)


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure_block(
    block: nn.Module, inputs: tuple[Any, ...], device: torch.device, repeats: int, warmup: int
) -> tuple[float, float, int, Any]:
    """(median forward s, median backward s, bytes saved for backward, the backward's working bytes, one output)
    of `block` on `inputs`."""
    clock = time.process_time if device.type == "cpu" else time.perf_counter
    param_storages = {p.untyped_storage().data_ptr() for p in block.parameters()}
    forwards, backwards, saved_bytes, backward_bytes = [], [], 0, 0
    output: Any = None
    grads: list[torch.Tensor] | None = None
    for iteration in range(warmup + repeats):
        saved: dict[int, int] = {}
        kept: list[weakref.ref[torch.UntypedStorage]] = []

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in param_storages and tensor.device.type != "meta":
                if storage.data_ptr() not in saved:
                    kept.append(weakref.ref(storage))
                saved[storage.data_ptr()] = storage.nbytes()
            return tensor

        _sync(device)
        start = clock()
        if iteration == 0:  # the counting pass (hooks cost time, so it is never a timed one)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                output = block(*inputs)
            saved_bytes = sum(saved.values())
        else:
            output = block(*inputs)
        _sync(device)
        middle = clock()
        differentiable = [t for t in _tensors(output) if t.requires_grad]
        if grads is None:
            generator = torch.Generator(device="cpu").manual_seed(0)
            grads = [torch.randn(t.shape, generator=generator, dtype=t.dtype).to(t.device) for t in differentiable]
        if differentiable and iteration == 0:
            backward_bytes = _backward_bytes(block, inputs, differentiable, grads, kept)
        elif differentiable:
            torch.autograd.backward(differentiable, grads)
        _sync(device)
        stop = clock()
        block.zero_grad(set_to_none=True)
        if iteration >= warmup:
            forwards.append(middle - start)
            backwards.append(stop - middle)
    return statistics.median(forwards), statistics.median(backwards), saved_bytes, backward_bytes, output


def _backward_bytes(block: nn.Module, inputs: tuple[Any, ...], outputs: list[torch.Tensor],
                    grads: list[torch.Tensor], saved: list[weakref.ref[torch.UntypedStorage]]) -> int:
    """The backward of `outputs` (from `grads`) with the block's gradients already there (a later micro-batch's:
    each new one is added in place), and the most bytes it held at once beyond what it started with: the
    gradients it computes before their inputs' saved tensors are freed (each freed one counts down)."""
    params = [p for p in block.parameters() if p.requires_grad]
    for param in params:
        param.grad = torch.zeros_like(param)
    tensors = [*params, *(p.grad for p in params), *_tensors(inputs), *outputs, *grads]
    with LiveBytes(existing=(s for s in [*(t.untyped_storage() for t in tensors), *(r() for r in saved)]
                             if s is not None)) as live:
        torch.autograd.backward(outputs, grads)
    return max(0, live.peak)


def _selective_bytes(wrapped: nn.Module, inputs: tuple[Any, ...]) -> int:
    """What `wrapped` (a block under selective recomputation) keeps for its backward after one forward: its
    inputs' storages and those its forward made that outlive it, but its outputs' (the stage holds those) and its
    weights'."""
    gc.collect()
    with LiveBytes() as live:
        output = wrapped(*inputs)
    gc.collect()
    # not its outputs', nor its weights' (a linear layer's transposed weight is a view the counter meets)
    mine = {id(t.untyped_storage()) for t in [*_tensors(output), *wrapped.parameters(), *wrapped.buffers()]}
    made = sum(size for key, size in live.live.items() if key not in mine)
    held = {id(s): s.nbytes() for s in (t.untyped_storage() for t in _tensors(inputs)) if id(s) not in mine}
    del output
    wrapped.zero_grad(set_to_none=True)
    return made + sum(held.values())


def profile_model(
    model: BlockModel,
    micro_batch_size: int,
    *,
    device: torch.device | str = "cpu",
    repeats: int = 5,
    warmup: int = 1,
    seed: int = 0,
    name: str | None = None,
    selective: Callable[[nn.Module], nn.Module] | None = None,
) -> ModelProfile:
    """Measure each block of `model` for one micro-batch of `micro_batch_size` samples on `device`.

    Times are medians over `repeats` runs after `warmup` untimed ones (the first run also counts the bytes
    saved for backward). Blocks are built one at a time, so the model never needs to fit whole. `selective`
    (a block -> the block under selective recomputation) adds each block's `selective_bytes`.
    """
    for label, value, least in (("micro_batch_size", micro_batch_size, 1), ("repeats", repeats, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(f"profile {label} must be a whole number >= {least}, got {value!r}",
                              hint=f"pass {label} >= {least}")
    device = torch.device(device)
    # a counting pass needs one run: iteration 0 is never timed, so at least one warm-up is required
    warmup = max(warmup, 1)
    example = model.example_input(micro_batch_size)
    items = example if isinstance(example, tuple) else (example,)
    inputs = _as_inputs(tuple(item.to(device) if isinstance(item, torch.Tensor) else item for item in items))
    blocks: list[BlockProfile] = []
    dtype = None
    for index in range(model.num_blocks):
        (block,) = build_blocks(model, [index], seed=seed, device=device)
        block.train(True)
        params = list({id(p): p for p in block.parameters()}.values())
        if dtype is None and params:
            dtype = str(params[0].dtype).removeprefix("torch.")
        forward_s, backward_s, saved_bytes, backward_bytes, output = _measure_block(block, inputs, device, repeats,
                                                                                    warmup)
        kept = None if selective is None else _selective_bytes(selective(block), inputs)
        outputs = _tensors(output)
        blocks.append(
            BlockProfile(
                index=index,
                name=type(block).__name__,
                forward_s=forward_s,
                backward_s=backward_s,
                param_bytes=_nbytes(params),
                activation_bytes=saved_bytes,
                output_bytes=_nbytes(outputs),
                selective_bytes=kept, backward_bytes=backward_bytes,
            )
        )
        inputs = _as_inputs(output if isinstance(output, tuple) else output)
        del block, output
    return ModelProfile(
        model=name or type(model).__name__,
        fingerprint=model_fingerprint(model),
        micro_batch_size=micro_batch_size,
        device=str(device),
        dtype=dtype or "float32",
        repeats=repeats,
        blocks=tuple(blocks),
    )


def default_sizes(micro_batch_size: int) -> tuple[int, ...]:
    """The sizes a profile measures by default: 1, 2, 4, ... below `micro_batch_size`, and it."""
    sizes = [1 << k for k in range(micro_batch_size.bit_length()) if 1 << k < micro_batch_size]
    return tuple(sizes + [micro_batch_size])


def profile_model_sizes(model: BlockModel, sizes: Sequence[int], *, reference: int | None = None,
                        **options: Any) -> ModelProfile:
    """`profile_model` at each of `sizes` and the fixed + per-sample fit of every block (see
    `pipetrain.partition.fit`), its costs given at `reference` (default: the largest size); one size: that
    profile alone. `options` go to `profile_model`."""
    distinct = sorted(set(sizes))
    if len(distinct) == 1:
        return profile_model(model, distinct[0], **options)
    return fit_profiles([profile_model(model, n, **options) for n in distinct], reference)

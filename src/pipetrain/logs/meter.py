"""The step meter: times each optimizer step on this rank and turns its `StepResult` into a `StepRecord`."""

from __future__ import annotations

import time

import torch
from torch import nn

from pipetrain.launch.memory import peak_memory_mb
from pipetrain.blocks import BlockModel, Tensors
from pipetrain.logs.mfu import ModelFlops, mfu, peak_tflops
from pipetrain.logs.records import StepRecord
from pipetrain.pipeline.engine import StepResult
from pipetrain.pipeline.shapes import meta_blocks

__all__ = ["StepMeter", "model_flops", "seq_len_of"]


def model_flops(model: BlockModel) -> ModelFlops | None:
    """The PaLM figures of `model` (see `pipetrain.logs.mfu`), or None when the model does not say its attention
    shape: N counts the parameters of every block on the meta device except those of `nn.Embedding` modules;
    (L, H, Q) come from the model's optional `attention_shape()` -> (layers, heads, head_dim)."""
    shape = getattr(model, "attention_shape", None)
    if shape is None:
        return None
    layers, heads, head_dim = shape()
    params = 0
    for block in meta_blocks(model):
        embedded = {id(p) for m in block.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
        params += sum(p.numel() for p in block.parameters() if id(p) not in embedded)
    return ModelFlops(params=params, layers=layers, heads=heads, head_dim=head_dim)


def seq_len_of(inputs: Tensors | None) -> int | None:
    """Positions per sample of a batch of token ids `[batch, seq, ...]` (the first tensor of a tuple)."""
    first = inputs[0] if isinstance(inputs, tuple) else inputs
    return int(first.shape[1]) if isinstance(first, torch.Tensor) and first.dim() >= 2 else None


class StepMeter:
    """Call `start()` before a step and `record(...)` after it. `per_token`: the loss counts tokens (then the
    record has the trained tokens and the window tokens the model processed, and both per second). MFU needs `flops` and a peak: `peak_tflops` (per device) when given, else
    the GPU's from `pipetrain.logs.mfu.PEAK_TFLOPS`; on CPU without `peak_tflops`, none."""

    def __init__(self, *, device: torch.device, devices: int, per_token: bool, precision: str,
                 flops: ModelFlops | None = None, peak_tflops_: float | None = None) -> None:
        self.device = device
        self.devices = devices
        self.per_token = per_token
        self.flops = flops
        self.peak = peak_tflops_
        if self.peak is None and device.type == "cuda":
            self.peak = peak_tflops(torch.cuda.get_device_name(device), precision)
        self._start = time.perf_counter()

    def start(self) -> None:
        self._start = time.perf_counter()

    def record(self, result: StepResult, *, step: int, epoch: int, lr: float, inputs: Tensors | None = None,
               grad_norm: float | None = None, skipped: bool = False) -> StepRecord:
        """The record of the step just finished (`result` is what `engine.step` returned)."""
        seconds = max(time.perf_counter() - self._start, 1e-9)
        tokens = result.count if self.per_token else None
        utilisation = None
        seq_len = seq_len_of(inputs)
        window = result.samples * seq_len if self.per_token and seq_len is not None else None
        if self.flops is not None and self.peak and seq_len is not None:
            utilisation = mfu(self.flops.per_step(result.samples, seq_len), seconds, devices=self.devices,
                              peak_tflops_per_device=self.peak)
        return StepRecord(step=step, epoch=epoch, loss=result.loss, accuracy=result.accuracy,
                          perplexity=result.perplexity, lr=float(lr), grad_norm=grad_norm, samples=result.samples,
                          tokens=tokens, step_time_s=seconds, samples_per_s=result.samples / seconds,
                          tokens_per_s=None if tokens is None else tokens / seconds, window_tokens=window,
                          window_tokens_per_s=None if window is None else window / seconds,
                          peak_mem_mb=peak_memory_mb(self.device), mfu=utilisation, skipped=skipped,
                          extras=dict(result.extras))

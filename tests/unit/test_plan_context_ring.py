"""The planner's ring traffic is the ring's: the bytes and dtype of every message context/ring.py passes to its
exchange (counted at `ring._start`, one rank of a ring of cp run in one process: pure, no process group) equal
`plan.context.ring_messages`, forward and backward; and the backward's exposed time follows from them."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pipetrain.context import ring
from pipetrain.context.blocks import BlockKernel
from pipetrain.plan.context import context_comm_s, ring_messages
from pipetrain.plan.hardware import named_gpu
from pipetrain.plan.predict import Layout
from pipetrain.plan.transformer import sizes_from_config

#: SmolLM2-135M's attention (9 heads, 3 key/value heads of 64)
CONFIG = dict(model_type="llama", vocab_size=512, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
              num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192)
DEVICE, NETWORK = named_gpu("h100-sxm", "bf16")


class _OneRank:
    """Rank 0 of a ring of `size` ranks, every block visible (the traffic does not depend on the mask)."""

    def __init__(self, size: int) -> None:
        self.size, self.rank, self.exchange, self.group = size, 0, "overlap", None

    def block_mask(self, source: int, a: int, b: int) -> bool:
        return True


def _sent(monkeypatch, cp: int, seq: int, dtype: torch.dtype) -> tuple[list, list]:
    """(forward, backward) messages the ring passes to its exchange: (dtype, bytes) per sequence, in order."""
    sent: list = []

    def start(tensor, layout):
        sent.append((tensor.dtype, tensor.numel() * tensor.element_size()))
        return lambda: tensor  # the attention's values do not matter here, only what is sent

    monkeypatch.setattr(ring, "_start", start)
    torch.manual_seed(0)
    part = seq // cp
    q = torch.randn(1, 9, part, 64).to(dtype)
    k, v = (torch.randn(1, 3, part, 64).to(dtype) for _ in range(2))
    layout, kernel = _OneRank(cp), BlockKernel()
    out, lse = ring._forward(q, k, v, layout, 0.125, kernel)
    forward = list(sent)
    sent.clear()
    ring._backward(torch.randn_like(q), q, k, v, out.to(dtype), lse, layout, 0.125, kernel)
    return forward, list(sent)


@pytest.mark.parametrize("cp, dtype", [(2, torch.bfloat16), (4, torch.bfloat16), (4, torch.float32)])
def test_the_planned_ring_messages_are_the_bytes_the_ring_sends(monkeypatch, cp, dtype):
    seq, element = 64, torch.finfo(dtype).bits // 8
    forward, backward = _sent(monkeypatch, cp, seq, dtype)
    split = sizes_from_config(CONFIG).context_split(seq, element)
    planned_forward, planned_backward = ring_messages(split, cp)
    assert [b for _, b in forward] == planned_forward and [b for _, b in backward] == planned_backward
    assert [d for d, _ in forward] == [dtype] * (cp - 1)  # keys and values in the activations' dtype
    assert [d for d, _ in backward] == [dtype, torch.float32] * (cp - 1) + [torch.float32]  # their fp32 gradients
    # the backward moves the key/value parts once more and their gradients cp times: not twice the forward
    assert sum(planned_backward) == pytest.approx(sum(planned_forward) * (1 + cp / (cp - 1) * 4 / element))


def test_the_backward_exposes_its_last_gradient_send_and_what_the_attention_cannot_hide():
    blocks = sizes_from_config(CONFIG).blocks(16384)
    layout = Layout(dp=1, pp=1, batch=2, chunks=1, precision="bf16", cp=4)
    lat = NETWORK.p2p_latency_s
    forward, backward = context_comm_s(blocks[1], 2, layout, NETWORK, DEVICE)
    last = 2 / 4 * ring_messages(blocks[1].context, 4)[1][-1] / NETWORK.p2p_bytes_per_s
    # long attention hides every send but the last gradients: a latency per message (2 with the send) + that send
    assert forward == pytest.approx(3 * lat)
    assert backward == pytest.approx((1 + 2 + 2 + 1) * lat + last + 2 * lat)
    slow = replace(NETWORK, p2p_bytes_per_s=1e8)  # a slow link: the attention hides little of the sends
    forward, backward = context_comm_s(blocks[1], 2, layout, slow, DEVICE)
    sends = [2 / 4 * sum(m) / slow.p2p_bytes_per_s for m in ring_messages(blocks[1].context, 4)]
    assert forward > 0.9 * sends[0] and backward > 0.9 * sends[1]
    assert backward > 3 * forward  # bf16 at cp 4: 3 key/value parts and 4 fp32 gradients against 3 parts

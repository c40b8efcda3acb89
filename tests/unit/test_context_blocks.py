"""The ring's block attention without processes: torch's fused kernel and the torch-ops fallback, forward and
backward, on random q/k/v (GQA) with a document mask, the causal mask and a row wholly masked in one block, against
autograd through plain softmax attention; the whole ring on a group of one rank (two zig-zag parts) against
transformers' packed-document sdpa; one document never sees another; the CUDA path's calls match torch's kernels'
schemas (on meta tensors). Tolerances: rtol 1e-5, atol 1e-5 (fp32; float64 reference)."""

from __future__ import annotations

import pytest
import torch

from pipetrain.compat.attention_kernels import fused_attention, fused_attention_backward
from pipetrain.context.attention import ContextMask
from pipetrain.context.blocks import KERNELS, BlockKernel, FusedKernel, _bias, block_kernel, merge_
from pipetrain.context.layout import zigzag_index
from pipetrain.context.ring import ring_attention

TOL = {"rtol": 1e-5, "atol": 1e-5}
B, H, HKV, L, D, SCALE = 2, 4, 2, 16, 8, 0.3


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, L, D, generator=gen) for h in (H, HKV, HKV))
    return q, k, v, torch.randn(B, H, L, D, generator=gen)


def _document_mask() -> torch.Tensor:
    """Causal within documents of rows [0:5 5:12 12:16] and [0:9 9:16]: [B, 1, L, L]."""
    starts = torch.tensor([[0] * 5 + [5] * 7 + [12] * 4, [0] * 9 + [9] * 7])
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    return (causal & (starts[:, :, None] == starts[:, None, :]))[:, None]


def _reference(q, k, v, mask, grad):
    """Softmax attention through autograd in float64: the output and the q, k, v gradients."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    scores = (q @ k.repeat_interleave(H // HKV, 1).transpose(-1, -2)) * SCALE
    out = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v.repeat_interleave(H // HKV, 1)
    out.backward(grad.double())
    return out.float(), q.grad.float(), k.grad.float(), v.grad.float()


@pytest.mark.parametrize("kernel", [FusedKernel(), BlockKernel()], ids=KERNELS)
def test_blocks_merged_and_their_backward_with_the_global_output_are_exact(kernel):
    """Keys in two blocks: the second hides every key from the first document's queries of row 0 (rows wholly
    masked in that block), the first is causal only for row 1's first 8 queries and keys; merged forward, and each
    block's backward given the merged output and log-sum-exp, equal the whole attention's."""
    q, k, v, grad = _inputs()
    mask = _document_mask()
    assert not mask[0, 0, :5, 8:].any() and mask[0, 0, 12:, 8:].any()  # wholly masked rows in block 2
    out = torch.zeros(B, H, L, D)
    lse = torch.full((B, H, L), float("-inf"))
    halves = (slice(0, 8), slice(8, 16))
    for ks in halves:
        merge_(out, lse, *kernel.forward(q, k[:, :, ks], v[:, :, ks], mask[..., ks], SCALE))
    gq, gk, gv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for ks in halves:
        dq, dk, dv = kernel.backward(grad, q, k[:, :, ks], v[:, :, ks], out, lse, mask[..., ks], SCALE)
        gq += dq
        gk[:, :, ks] += dk
        gv[:, :, ks] += dv
    for actual, expected in zip((out, gq, gk, gv), _reference(q, k, v, mask, grad)):
        torch.testing.assert_close(actual, expected, **TOL)


def test_fused_and_torch_ops_blocks_agree():
    """Forward on the rows that see a key (a wholly masked row's output is weighted 0 by the merge: its
    log-sum-exp is about -1e30 in both), and the backward given a global output and log-sum-exp."""
    q, k, v, grad = _inputs(1)
    mask = _document_mask()[..., 8:]  # a block with wholly masked rows
    seen = mask[:, 0].any(-1)[:, None].expand(B, H, L)
    assert not seen.all()
    fused, ops = FusedKernel(), BlockKernel()
    (fo, fl), (oo, ol) = (kernel.forward(q, k[:, :, 8:], v[:, :, 8:], mask, SCALE) for kernel in (fused, ops))
    torch.testing.assert_close(fo[seen], oo[seen], **TOL)
    torch.testing.assert_close(fl[seen], ol[seen], **TOL)
    assert fl[~seen].max() < -1e29 and ol[~seen].max() < -1e29
    out, lse = _reference(q, k, v, _document_mask(), grad)[0], torch.logsumexp(torch.randn(B, H, L, 16), -1)
    for a, b in zip(fused.backward(grad, q, k[:, :, 8:], v[:, :, 8:], out, lse, mask, SCALE),
                    ops.backward(grad, q, k[:, :, 8:], v[:, :, 8:], out, lse, mask, SCALE)):
        torch.testing.assert_close(a.float(), b, **TOL)


def test_a_causal_block_runs_as_the_kernels_causal_mask():
    causal = torch.ones(1, 1, 8, 8, dtype=torch.bool).tril()
    assert _bias(causal, torch.float32) == (None, True)
    bias, is_causal = _bias(_document_mask(), torch.float32)
    assert not is_causal and bias.dtype == torch.float32 and bias.min() == -1e30
    assert isinstance(block_kernel("fused", torch.zeros(1)), FusedKernel)
    assert type(block_kernel("ops", torch.zeros(1))) is BlockKernel
    assert type(block_kernel("fused", torch.zeros(1, dtype=torch.int64))) is BlockKernel  # fallback


def _one_rank(starts: torch.Tensor | None, kernel: str) -> ContextMask:
    index = zigzag_index(L, 1, 0)[None]
    return ContextMask(None, 0, 1, "ring", index, None if starts is None else starts[None], kernel=kernel)


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_ring_of_one_rank_equals_document_attention(kernel):
    """The ring's autograd function (two parts: the diagonal blocks and the back part over the front one)."""
    q, k, v, grad = _inputs(2)
    mask = _document_mask()
    starts = torch.tensor([[0] * 5 + [5] * 7 + [12] * 4, [0] * 9 + [9] * 7])
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*leaves, _one_rank(starts, kernel), SCALE)
    out.backward(grad.transpose(1, 2))
    expected = _reference(q, k, v, mask, grad)
    torch.testing.assert_close(out.transpose(1, 2), expected[0], **TOL)
    for leaf, want in zip(leaves, expected[1:]):
        torch.testing.assert_close(leaf.grad, want, **TOL)


@pytest.mark.parametrize("kernel", KERNELS)
def test_one_document_never_sees_another(kernel):
    """Changing the keys and values of row 0's first document (tokens 0-4) changes neither the output nor the
    gradients of its second (tokens 5-11); without the documents (one sequence) it does: the test can fail."""
    q, k, v, grad = _inputs(3)
    starts = torch.tensor([[0] * 5 + [5] * 7 + [12] * 4, [0] * 9 + [9] * 7])
    k2, v2 = k.clone(), v.clone()
    k2[0, :, :5] += 1.0
    v2[0, :, :5] -= 2.0

    def second_document(keys, values, layout):
        leaves = [t.clone().requires_grad_() for t in (q, keys, values)]
        out = ring_attention(*leaves, layout, SCALE)
        out.backward(grad.transpose(1, 2))
        second = slice(5, 12)
        return [out[0, second], leaves[0].grad[0, :, second], leaves[1].grad[0, :, second],
                leaves[2].grad[0, :, second]]

    for a, b in zip(second_document(k, v, _one_rank(starts, kernel)),
                    second_document(k2, v2, _one_rank(starts, kernel))):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    one = [second_document(kk, vv, _one_rank(None, kernel))[0] for kk, vv in ((k, v), (k2, v2))]
    assert (one[0] - one[1]).abs().max() > 1e-2


@pytest.mark.parametrize("bias", [False, True])
def test_the_cuda_kernels_calls_match_their_schemas(bias):
    """The memory-efficient kernel's forward and backward on meta tensors (GQA heads repeated and folded back; the
    log-sum-exp cut to the queries): the shapes the CUDA path gives."""
    q = torch.empty(2, 4, 40, 64, device="meta")
    k, v = torch.empty(2, 2, 24, 64, device="meta"), torch.empty(2, 2, 24, 64, device="meta")
    mask = torch.empty(2, 1, 40, 24, device="meta") if bias else None
    out, lse = fused_attention(q, k, v, mask, False, 0.125)
    assert out.shape == q.shape and lse.shape == (2, 4, 40) and lse.dtype == torch.float32
    grads = fused_attention_backward(torch.empty_like(out), q, k, v, out, lse, mask, False, 0.125)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_ring_under_non_reentrant_checkpoint_equals_the_ring(kernel):
    """torch.utils.checkpoint (non-reentrant) runs the ring's function again in the backward: the same gradients."""
    q, k, v, grad = _inputs(4)
    starts = torch.tensor([[0] * 5 + [5] * 7 + [12] * 4, [0] * 9 + [9] * 7])

    def grads(checkpointed: bool) -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]

        def attend(*inputs: torch.Tensor) -> torch.Tensor:
            return ring_attention(*(t * 1.5 for t in inputs), _one_rank(starts, kernel), SCALE)

        if checkpointed:
            out = torch.utils.checkpoint.checkpoint(attend, *leaves, use_reentrant=False)
        else:
            out = attend(*leaves)
        out.backward(grad.transpose(1, 2))
        return [out.detach()] + [leaf.grad for leaf in leaves]

    for a, b in zip(grads(True), grads(False)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

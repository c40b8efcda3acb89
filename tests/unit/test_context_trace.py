"""Context parallelism in traces, without a process group: each ring step's exchange and each all-to-all is a span
of a recorded step, forward and backward (the exchanges faked: a rank receives what it sends), nothing
outside one; the pure reports place the spans in their compute span and total them per step."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pipetrain.context import ring, ulysses
from pipetrain.context.attention import ContextMask
from pipetrain.context.layout import zigzag_index
from pipetrain.pipeline.timeline import Recorder
from pipetrain.trace.spans import CP_KINDS, KIND_LABELS, Span, within_compute
from pipetrain.trace.summary import summarize, summary_lines

MS = 1_000_000


class _Done:
    def wait(self) -> None:
        pass


@pytest.fixture
def one_rank(monkeypatch):
    """dist's point-to-point and all-to-all calls of a group of one rank: what is sent comes back."""
    sent: list[torch.Tensor] = []

    def batch(ops):
        (_, tensor), (_, received) = ops
        received.copy_(tensor)
        sent.append(tensor)
        return [_Done(), _Done()]

    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer, group: (op, tensor))
    monkeypatch.setattr(dist, "batch_isend_irecv", batch)
    monkeypatch.setattr(dist, "all_to_all_single", lambda out, tensor, group=None: out.copy_(tensor))
    return sent


def _kinds(recorder: Recorder) -> list[str]:
    return [record[0] for record in recorder.records]


def _two_rank_layout(exchange: str) -> ContextMask:
    """Rank 0 of a ring of 2 (the exchanges faked: rank 0 receives its own blocks)."""
    index = torch.stack([zigzag_index(8, 2, r) for r in range(2)])
    return ContextMask(None, 0, 2, "ring", index, None, exchange=exchange)


@pytest.mark.parametrize("exchange", ["overlap", "sync"])
def test_each_ring_exchange_is_a_span_forward_and_backward(one_rank, monkeypatch, exchange):
    """Forward: one exchange of keys and values (2 ranks: one step after the first); backward: that one again and
    the key/value gradients' two (after each step, the last one home to the owner); nothing outside a step."""
    monkeypatch.setattr(ring, "_peers", lambda group: (0, 0))
    q, k, v = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3))
    recorder = Recorder()
    with recorder.recording(0):
        ring.ring_attention(q, k, v, _two_rank_layout(exchange), 0.5).sum().backward()
    assert _kinds(recorder) == ["cp_ring"] * 4 + ["step"]
    assert [t.shape for t in one_rank] == [(2, 1, 2, 4, 8)] * 4  # keys and values stacked, and their gradients
    assert k.grad is not None and v.grad is not None and q.grad is not None
    ring.ring_attention(q, k, v, _two_rank_layout(exchange), 0.5)  # outside a recorded step: no span
    assert len(recorder.records) == 5 and len(one_rank) == 5


def test_each_all_to_all_is_a_span_forward_and_backward(one_rank):
    x = torch.randn(2, 3, requires_grad=True)
    recorder = Recorder()
    with recorder.recording(0):
        ulysses.all_to_all_single(x, None).sum().backward()
    assert _kinds(recorder) == ["cp_all_to_all", "cp_all_to_all", "step"]
    assert all(kind in KIND_LABELS for kind in CP_KINDS)


def test_exchanges_get_their_compute_span_and_the_summary_totals_them():
    spans = [Span(0, "step", 0, 10 * MS, 0), Span(0, "F", 0, 4 * MS, 0, 1, 2), Span(0, "B", 4 * MS, 9 * MS, 0, 1, 2),
             Span(0, "cp_ring", 1 * MS, 2 * MS, 0), Span(0, "cp_ring", 5 * MS, 7 * MS, 0),
             Span(0, "cp_all_to_all", 9 * MS, 9 * MS + MS // 2, 0)]
    placed = within_compute(spans)
    cp = [s for s in placed if s.kind in CP_KINDS]
    assert [(s.stage, s.microbatch) for s in cp] == [(1, 2), (1, 2), (-1, -1)]
    assert cp[0].name == "CP ring step"
    (summary,) = summarize(placed)
    assert summary.cp_comm_s == pytest.approx(3.5e-3) and summary.cp_exchanges == 3 and summary.tp_collectives == 0
    lines = summary_lines([summary], 0.0)
    assert "CP comm ms" in lines[0] and "TP comm" not in lines[0] and lines[1].split()[-2:] == ["3.50", "3"]
    (plain,) = summarize([s for s in spans if s.kind not in CP_KINDS])
    assert "CP comm" not in summary_lines([plain], 0.0)[0]  # no CP column without CP

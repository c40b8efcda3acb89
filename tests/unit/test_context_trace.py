"""Context parallelism in traces, without a process group: each ring step's exchange and each all-to-all is a span
of a recorded step, forward and backward (the exchanges faked: a ring of one rank receives what it sends), nothing
outside one; the pure reports place the spans in their compute span and total them per step."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pipetrain.context import ring, ulysses
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


def test_each_ring_exchange_is_a_span_forward_and_backward(one_rank):
    x = torch.randn(2, 3, requires_grad=True)
    recorder = Recorder()
    with recorder.recording(0):
        y = ring._Exchange.apply(x, None, 0, 0)
        y.sum().backward()
    assert torch.equal(y, x) and torch.equal(x.grad, torch.ones(2, 3))
    assert _kinds(recorder) == ["cp_ring", "cp_ring", "step"]  # the keys and values, then their gradients
    ring._Exchange.apply(x, None, 0, 0)  # outside a recorded step: nothing
    assert len(recorder.records) == 3 and len(one_rank) == 3


def test_an_overlapped_exchange_is_a_span_at_each_wait(one_rank, monkeypatch):
    """The overlapped exchange (posted, then waited for after the attention): a span at the forward's wait and one
    at the backward's; the gradient is the one received back (a peer that adds 1 to what it is sent tells it from
    the gradient that was sent)."""
    def batch(ops):
        (_, tensor), (_, received) = ops
        received.copy_(tensor + 1)
        one_rank.append(tensor)
        return [_Done(), _Done()]

    monkeypatch.setattr(dist, "batch_isend_irecv", batch)
    x = torch.randn(2, 3, requires_grad=True)
    recorder = Recorder()
    with recorder.recording(0):
        flight = ring._InFlight(None, 0, 0)
        y = ring._Wait.apply(ring._Post.apply(x, flight), flight)
        (2 * y).sum().backward()
    assert torch.equal(y, x + 1) and torch.equal(x.grad, torch.full((2, 3), 3.0))
    assert _kinds(recorder) == ["cp_ring", "cp_ring", "step"] and len(one_rank) == 2


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

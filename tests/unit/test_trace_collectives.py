"""TP collectives in traces without a process group: the private DTensor methods the tracer wraps still exist
with the arguments it reads, are wrapped only inside a recorded step, record only the `tp` axis, and the pure
reports place and total the spans."""

from __future__ import annotations

import inspect

import pytest
from torch.distributed.tensor import placement_types

from pipetrain.pipeline.timeline import Recorder
from pipetrain.compat.dtensor import PLACEMENT_COLLECTIVES
from pipetrain.trace.collectives import tp_collective_spans
from pipetrain.trace.spans import KIND_LABELS, TP_KINDS, Span, within_compute
from pipetrain.trace.summary import summarize, summary_lines

MS = 1_000_000


def test_the_private_dtensor_methods_still_exist_with_mesh_and_mesh_dim():
    """Fails loudly when torch moves or renames a method compat/dtensor.py wraps."""
    for cls_name, name, kind in PLACEMENT_COLLECTIVES:
        cls = getattr(placement_types, cls_name)
        assert name in cls.__dict__, f"torch.distributed.tensor.placement_types.{cls_name}.{name} moved"
        params = list(inspect.signature(cls.__dict__[name]).parameters)
        assert "mesh" in params and "mesh_dim" in params, (cls_name, name, params)
        assert kind in TP_KINDS and kind in KIND_LABELS


class _Mesh:
    def __init__(self, names):
        self.mesh_dim_names = names


def test_wrapped_only_inside_the_block_and_only_the_tp_axis_recorded(monkeypatch):
    calls = []

    def fake(self, tensor, mesh, mesh_dim):
        calls.append(mesh_dim)
        return tensor

    monkeypatch.setattr(placement_types.Partial, "_reduce_value", fake)
    recorder = Recorder()
    partial = placement_types.Partial()
    with tp_collective_spans(recorder):
        assert placement_types.Partial.__dict__["_reduce_value"] is not fake
        assert partial._reduce_value("x", _Mesh(("dp", "pp", "tp")), 2) == "x"  # tp: recorded
        assert partial._reduce_value("x", _Mesh(("dp", "pp", "tp")), mesh_dim=0) == "x"  # dp: not recorded
        partial._reduce_value("x", _Mesh(None), 0)  # unnamed mesh: not pipetrain's TP axis
    assert placement_types.Partial.__dict__["_reduce_value"] is fake  # restored
    partial._reduce_value("x", _Mesh(("tp",)), 0)  # outside: nothing recorded
    assert calls == [2, 0, 0, 0]
    recorder._resolve()
    assert [r[0] for r in recorder.records] == ["tp_all_reduce"]


def test_an_async_result_is_waited_for_inside_the_span(monkeypatch):
    class Async:
        waited = False

        def wait(self):
            Async.waited = True
            return "done"

    monkeypatch.setattr(placement_types.Shard, "_to_replicate_tensor",
                        lambda self, local_tensor, mesh, mesh_dim, current_logical_shape: Async())
    recorder = Recorder()
    with tp_collective_spans(recorder):
        assert placement_types.Shard(0)._to_replicate_tensor("x", _Mesh(("tp",)), 0, (4,)) == "done"
    assert Async.waited
    recorder._resolve()
    assert [r[0] for r in recorder.records] == ["tp_all_gather"]


def test_collectives_get_their_compute_span_and_the_summary_totals_them():
    spans = [Span(0, "step", 0, 10 * MS, 0), Span(0, "F", 0, 4 * MS, 0, 1, 3), Span(0, "B", 4 * MS, 9 * MS, 0, 1, 3),
             Span(0, "recompute", 4 * MS, 6 * MS, 0, 1, 3),
             Span(0, "tp_all_reduce", 1 * MS, 2 * MS, 0), Span(0, "tp_all_reduce", 5 * MS, 6 * MS, 0),
             Span(0, "tp_all_reduce", 7 * MS, 8 * MS, 0), Span(0, "tp_all_gather", 9 * MS, 9 * MS + MS // 2, 0)]
    placed = within_compute(spans)
    tp = [s for s in placed if s.kind in TP_KINDS]
    assert [(s.stage, s.microbatch) for s in tp] == [(1, 3), (1, 3), (1, 3), (-1, -1)]
    assert tp[0].name == "TP all-reduce"
    (summary,) = summarize(placed)
    assert summary.tp_comm_s == pytest.approx(3.5e-3) and summary.tp_collectives == 4
    assert summary.busy == pytest.approx(0.9)  # the collectives sit inside the compute spans
    lines = summary_lines([summary], 0.0)
    assert "TP comm ms" in lines[0] and lines[1].split()[-2:] == ["3.50", "4"]
    (plain,) = summarize([s for s in spans if s.kind not in TP_KINDS])
    assert "TP comm" not in summary_lines([plain], 0.0)[0]  # no TP column without TP

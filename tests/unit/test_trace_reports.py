"""The pure trace reports: span unions, the per-rank summary and ideal bubble, the Chrome trace and the Gantt PNG."""

from __future__ import annotations

import json

import pytest

from pipetrain.errors import ConfigError
from pipetrain.trace.chrome import chrome_trace, spans_from_chrome_trace
from pipetrain.trace.files import check_trace_dir, write_trace_files
from pipetrain.trace.spans import Span, spans_from_dicts, spans_to_dicts, union_ns
from pipetrain.trace.summary import ideal_bubble, summarize

MS = 1_000_000


def gpipe_like() -> list[Span]:
    """pp=2, 2 micro-batches, unit (1 ms) forwards and 2 ms backwards, perfectly scheduled; step = 0..10 ms."""
    spans = [Span(0, "step", 0, 10 * MS, 0), Span(1, "step", 0, 10 * MS, 0)]
    for mb in range(2):
        spans.append(Span(0, "F", mb * MS, (mb + 1) * MS, 0, 0, mb))
        spans.append(Span(1, "F", (mb + 1) * MS, (mb + 2) * MS, 0, 1, mb))
        spans.append(Span(1, "B", (3 + 2 * mb) * MS, (5 + 2 * mb) * MS, 0, 1, mb))
        spans.append(Span(0, "B", (5 + 2 * mb) * MS, (7 + 2 * mb) * MS, 0, 0, mb))
    spans.append(Span(0, "wait", 2 * MS, 5 * MS, 0))
    spans.append(Span(0, "optimizer", 9 * MS, 10 * MS, 0))
    return spans


def test_union_counts_overlaps_once():
    assert union_ns([]) == 0
    assert union_ns([(0, 2), (1, 3), (5, 6)]) == 4
    assert union_ns([(5, 6), (0, 10)]) == 10


def test_ideal_bubble_formulas():
    assert ideal_bubble("gpipe", 2, 4) == pytest.approx(1 / 5)
    assert ideal_bubble("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert ideal_bubble("interleaved-1f1b", 4, 8, 2) == pytest.approx(3 / 19)
    assert ideal_bubble("gpipe", 1, 4) == 0


def test_summary_of_a_perfect_schedule_equals_the_ideal_bubble():
    by_rank = {s.rank: s for s in summarize(gpipe_like())}
    # window 0..9 ms; each rank computes 6 ms of it: bubble 3/9 = (p-1)/(m+p-1) with backward = 2 x forward
    assert by_rank[0].bubble == pytest.approx(3 / 9) and by_rank[1].bubble == pytest.approx(3 / 9)
    assert ideal_bubble("gpipe", 2, 2) == pytest.approx(3 / 9)
    assert by_rank[0].busy == pytest.approx(0.6) and by_rank[0].comm_wait == pytest.approx(0.3)
    assert by_rank[0].optimizer_s == pytest.approx(1e-3) and by_rank[1].comm_wait == 0
    assert by_rank[0].step_s == pytest.approx(0.01)


def test_spans_round_trip_and_labels():
    spans = gpipe_like()
    assert spans_from_dicts(json.loads(json.dumps(spans_to_dicts(spans)))) == spans
    assert spans[2].name == "F0" and Span(0, "recompute", 0, 1, 0, 0, 3).name == "R3"


def test_chrome_trace_one_track_per_rank_in_microseconds():
    doc = chrome_trace(gpipe_like(), metadata={"schedule": "gpipe"})
    complete = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {(e["pid"], e["tid"]) for e in complete} == {(0, 0), (1, 1)}
    f1 = next(e for e in complete if e["name"] == "F1" and e["pid"] == 1)
    assert f1["ts"] == 2000.0 and f1["dur"] == 1000.0 and f1["args"] == {"step": 0, "what": "forward", "stage": 1,
                                                                         "microbatch": 1}
    assert doc["otherData"] == {"schedule": "gpipe"}
    assert sorted(spans_from_chrome_trace(json.loads(json.dumps(doc))), key=repr) == sorted(gpipe_like(), key=repr)


def test_files_are_written_and_an_unwritable_folder_is_a_config_error(tmp_path):
    files = write_trace_files(gpipe_like(), tmp_path / "t", ideal_bubble=1 / 3, title="gpipe")
    assert files.gantt.read_bytes()[:4] == b"\x89PNG"
    assert json.loads(files.trace.read_text())["traceEvents"]
    assert "33.3%" in files.summary.read_text()
    assert not list((tmp_path / "t").glob(".*"))
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="cannot write the trace folder"):
        check_trace_dir(blocker / "trace")

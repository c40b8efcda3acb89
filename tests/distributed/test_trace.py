"""Traced pipeline runs on spawned gloo ranks: the trace holds every micro-batch's work once, in order, on aligned
clocks, its step spans match the step times measured outside the tracer, and the files are written.

One spawned job (2 ranks) runs every case in turn, as in harness.py; the last, `tp2`, splits the classifier's
layers over both ranks (tensor parallelism, one stage) and checks that its collectives are spans of their own.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.launch.env import free_port
from pipetrain.launch.spawn import RankSpec, spawn
from pipetrain.session import build_session, close_session, join_job
from pipetrain.trace.chrome import spans_from_chrome_trace
from pipetrain.trace.spans import TP_KINDS, spans_from_dicts
from pipetrain.trace.tracer import Tracer
from tests.distributed.harness import MODEL_CONFIG, make_batches, make_model

CHUNKS = 4
WARMUP, TRACED = 1, 2
#: name -> (schedule, checkpoint policy)
CASES = {
    "gpipe": ("gpipe", "never"),
    "1f1b": ("1f1b", "never"),
    "1f1b-recompute": ("1f1b", "always"),
    "interleaved-1f1b": ("interleaved-1f1b", "never"),
    "zero-bubble": ("zero-bubble", "never"),
}
#: the tensor-parallel case: (schedule, checkpoint policy) at tp=2, pp=1
TP_CASE = ("tp2", ("gpipe", "always"))
#: the traced step span may differ from the step time measured around it by this fraction, plus STEP_SLACK_NS for
#: what lies between the two clocks' readings (the `with` itself; on 2 shared cores a preemption: 1.5 ms over a
#: 50 ms step was seen once in two clean-clone suites)
STEP_TOLERANCE = 0.02
STEP_SLACK_NS = 5_000_000


def _case(spec: RankSpec, device, name: str, out: Path) -> None:
    if name == TP_CASE[0]:
        schedule, policy = TP_CASE[1]
        parallel = ParallelConfig(tp=2, pipeline=PipelineConfig(pp=1, schedule=schedule, n_microbatches=CHUNKS,
                                                                checkpoint=policy))
    else:
        schedule, policy = CASES[name]
        parallel = ParallelConfig(pipeline=PipelineConfig(pp=2, schedule=schedule, n_microbatches=CHUNKS, checkpoint=policy))
    session = build_session(make_model(), parallel, device, seed=0)
    engine = session.engine
    optimizer = torch.optim.SGD(engine.parameters(), lr=0.01)
    tracer = Tracer(engine, out / name, steps=TRACED, warmup=WARMUP)
    outside = []
    for x, y in make_batches([8] * (WARMUP + TRACED + 1)):
        start = time.perf_counter_ns()
        with tracer.step() as traced:
            optimizer.zero_grad()
            engine.step(x, y)
            with tracer.span("optimizer"):
                optimizer.step()
        if traced:
            outside.append(time.perf_counter_ns() - start)
    files = tracer.close()
    (out / name / f"outside{spec.rank}.json").write_text(json.dumps(outside))
    if files is not None:
        (out / name / "lines.txt").write_text("\n".join(files.lines()))
        (out / name / "spans.json").write_text(json.dumps([
            dict(rank=s.rank, kind=s.kind, start_ns=s.start_ns, end_ns=s.end_ns, step=s.step, stage=s.stage,
                 microbatch=s.microbatch)
            for s in spans_from_chrome_trace(json.loads((out / name / "trace.json").read_text()))]))


def _worker(spec: RankSpec, out: str) -> None:
    device = join_job(spec)
    try:
        for name in (*CASES, TP_CASE[0]):
            _case(spec, device, name, Path(out))
    finally:
        close_session()


@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trace")
    spawn(_worker, ranks=range(2), world_size=2, master_addr="127.0.0.1", master_port=free_port(),
          args=(str(out),), timeout_s=300)
    return out


def _load(traced: Path, name: str):
    return spans_from_dicts(json.loads((traced / name / "spans.json").read_text()))


@pytest.mark.parametrize("name", CASES)
def test_trace_has_one_track_per_rank_and_the_files(traced, name):
    doc = json.loads((traced / name / "trace.json").read_text())
    tracks = {(e["pid"], e["tid"]) for e in doc["traceEvents"] if e["ph"] == "X"}
    assert tracks == {(0, 0), (1, 1)}
    png = (traced / name / "gantt.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert "ideal" in (traced / name / "lines.txt").read_text()


@pytest.mark.parametrize("name", CASES)
def test_every_microbatch_once_and_backward_after_forward(traced, name):
    spans = _load(traced, name)
    schedule, policy = CASES[name]
    stages_per_rank = 2 if schedule in ("interleaved-1f1b", "zero-bubble") else 1
    backward_kinds = ("I", "W") if schedule == "zero-bubble" else ("B",)
    for step in range(TRACED):
        for rank in (0, 1):
            mine = [s for s in spans if s.rank == rank and s.step == step]
            stages = {rank + 2 * v for v in range(stages_per_rank)}
            for kind in ("F", *backward_kinds):
                counts = Counter((s.stage, s.microbatch) for s in mine if s.kind == kind)
                assert counts == Counter({(st, mb): 1 for st in stages for mb in range(CHUNKS)}), (kind, counts)
            forward = {(s.stage, s.microbatch): s for s in mine if s.kind == "F"}
            for s in mine:
                if s.kind in backward_kinds:
                    assert s.start_ns >= forward[(s.stage, s.microbatch)].end_ns
            recomputed = [s for s in mine if s.kind == "recompute"]
            assert len(recomputed) == (CHUNKS * stages_per_rank if policy == "always" else 0)


@pytest.mark.parametrize("name", CASES)
def test_step_span_matches_the_outside_step_time(traced, name):
    spans = _load(traced, name)
    for rank in (0, 1):
        outside = json.loads((traced / name / f"outside{rank}.json").read_text())
        steps = sorted((s for s in spans if s.rank == rank and s.kind == "step"), key=lambda s: s.step)
        assert len(steps) == len(outside) == TRACED
        for step, measured in zip(steps, outside):
            assert step.duration_ns <= measured, (step.duration_ns, measured)  # the span lies inside the outside timer
            assert measured - step.duration_ns <= STEP_TOLERANCE * measured + STEP_SLACK_NS, (step.duration_ns, measured)
            work = [s for s in spans if s.rank == rank and s.step == step.step and s.kind != "step"]
            assert all(step.start_ns <= s.start_ns and s.end_ns <= step.end_ns for s in work)
            top = [s for s in work if s.kind not in ("recompute",)]
            assert sum(s.duration_ns for s in top) <= step.duration_ns


def test_1f1b_holds_at_most_pp_microbatches_in_flight_on_the_first_stage(traced):
    spans = _load(traced, "1f1b")
    for step in range(TRACED):
        events = []
        for s in spans:
            if s.rank == 0 and s.step == step and s.stage == 0:
                if s.kind == "F":
                    events.append((s.start_ns, 1))
                elif s.kind == "B":
                    events.append((s.end_ns, -1))
        in_flight = peak = 0
        for _, change in sorted(events):
            in_flight += change
            peak = max(peak, in_flight)
        assert peak == 2  # pp = 2: the warm-up runs two forwards, then one backward frees one
    gpipe = [s for s in _load(traced, "gpipe") if s.rank == 0 and s.step == 0 and s.kind in ("F", "B")]
    assert [s.kind for s in sorted(gpipe, key=lambda s: s.start_ns)] == ["F"] * CHUNKS + ["B"] * CHUNKS


def test_tp_collectives_are_spans_inside_the_forwards_and_backwards(traced):
    """tp=2, one stage, 4 micro-batches recomputed: each of the MODEL_CONFIG's encoder layers all-reduces its
    attention and its MLP output in forward (2), its two split inputs' gradients in backward (2), and the
    recomputed forward runs its 2 again inside the backward; every all-reduce lies inside the F / B / R span
    of its micro-batch, and the summary reports the time in them (the optimizer step's all-gathers of the
    strided in_proj weights, outside any compute, are TP collectives too)."""
    name = TP_CASE[0]
    spans = _load(traced, name)
    layers = MODEL_CONFIG.nlayers
    counts = set()
    for step in range(TRACED):
        for rank in (0, 1):
            mine = [s for s in spans if s.rank == rank and s.step == step]
            reduces = [s for s in mine if s.kind == "tp_all_reduce"]
            for mb in range(CHUNKS):
                forward = [s for s in mine if s.kind == "F" and s.microbatch == mb]
                backward = [s for s in mine if s.kind == "B" and s.microbatch == mb]
                assert len(forward) == len(backward) == 1
                inside_f = [c for c in reduces if forward[0].start_ns <= c.start_ns and c.end_ns <= forward[0].end_ns]
                inside_b = [c for c in reduces if backward[0].start_ns <= c.start_ns and c.end_ns <= backward[0].end_ns]
                assert len(inside_f) == 2 * layers
                assert len(inside_b) == 2 * layers + 2 * layers  # backward's 2 per layer + the recomputed forward's
                assert all(c.stage == 0 and c.microbatch == mb for c in inside_f + inside_b)
            assert len(reduces) == CHUNKS * 6 * layers
            counts.add(len([s for s in mine if s.kind in TP_KINDS]))
    assert len(counts) == 1  # the same collectives every step and rank
    per_step = counts.pop()
    summary = json.loads((traced / name / "summary.json").read_text())
    for rank in summary["ranks"]:
        assert rank["tp_collectives"] == per_step and 0 < rank["tp_comm_s"] < rank["step_s"]
    assert "TP comm ms" in (traced / name / "lines.txt").read_text()
    plain = [s for s in _load(traced, "gpipe") if s.kind in TP_KINDS]
    assert not plain  # no TP axis, no TP span

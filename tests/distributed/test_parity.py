"""Transparency: pipelined, data-parallel and hybrid runs give the losses, gradients and parameters of one process.

Each world size is one spawned gloo job running every case in turn (see harness.py); the tests then
compare each case with the single-process reference. Tolerance: float32 sums in another order, the
figures torch's own pipelining tests use (rtol 1e-5, atol 4e-5), over 3 SGD steps.
"""

from __future__ import annotations

import pytest

from pipetrain.config import ParallelConfig, PipelineConfig
from tests.distributed.harness import (
    assert_parity,
    make_batches,
    make_float_batches,
    make_token_batches,
    parallel_runs,
    reference_run,
    with_mask_input,
)

# the first test waits for both spawned jobs (every case of each world size): over the default 300 s on a busy machine
pytestmark = pytest.mark.timeout(900)

RTOL, ATOL = 1e-5, 4e-5
# 8, then a short batch that 4 chunks do not divide (4 x 1 + a remainder of 2), then one smaller than 4
PIPELINE_BATCHES = [8, 6, 3]
# per replica of dp=2: the same three shapes
DP_BATCHES = [16, 12, 6]
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
POLICIES = ("never", "except_last", "always")


def _pipe(pp: int, schedule: str, policy: str = "never", dp: int = 1, dp_mode: str = "ddp", shape_cache: int = 16,
          chunks: int = 4, unit: str = "stage", every: int = 1, offload: bool = False, matmuls: str = "all",
          **parallel) -> ParallelConfig:
    pipeline = PipelineConfig(pp=pp, schedule=schedule, n_microbatches=chunks, checkpoint=policy,
                              shape_cache=shape_cache, recompute_unit=unit, recompute_every=every,
                              offload_activations=offload, selective_matmuls=matmuls)
    return ParallelConfig(dp=dp, dp_mode=dp_mode, pipeline=pipeline, **parallel)


# per replica of dp=4: the same three shapes
DP4_BATCHES = [32, 24, 12]
# the memory modes (docs/memory.md): FSDP resharding after forward (gradients then accumulate sharded), HSDP,
# per-block, every-k-th and selective recomputation, activation offloading (the CUDA path with host-to-host copies)
MEMORY_CASES = {
    2: {
        "dp2-fsdp-reshard-always": (_pipe(1, "gpipe", dp=2, dp_mode="fsdp", fsdp_reshard="always"), DP_BATCHES),
        "pp2-1f1b-selective": (_pipe(2, "1f1b", "always", unit="selective"), PIPELINE_BATCHES),
        "pp2-1f1b-layer-every2": (_pipe(2, "1f1b", "except_last", unit="layer", every=2), PIPELINE_BATCHES),
        "pp2-1f1b-offload": (_pipe(2, "1f1b", offload=True), PIPELINE_BATCHES),
    },
    4: {
        "dp4-hsdp": (_pipe(1, "gpipe", dp=4, dp_mode="hsdp", dp_shard=2), DP4_BATCHES),
        "dp4-hsdp-reshard-always": (_pipe(1, "gpipe", dp=4, dp_mode="hsdp", dp_shard=2, fsdp_reshard="always"),
                                    DP4_BATCHES),
        "dp4-fsdp-reshard-2": (_pipe(1, "gpipe", dp=4, dp_mode="fsdp", fsdp_reshard=2), DP4_BATCHES),
        "dp2xpp2-1f1b-fsdp-reshard-always": (_pipe(2, "1f1b", dp=2, dp_mode="fsdp", fsdp_reshard="always"),
                                             DP_BATCHES),
    },
}


WORLD_CASES = {
    2: {
        **{f"pp2-{s}-{p}": (_pipe(2, s, p), PIPELINE_BATCHES) for s in SCHEDULES for p in POLICIES},
        "dp2-ddp": (_pipe(1, "gpipe", dp=2), DP_BATCHES),
        "dp2-fsdp": (_pipe(1, "gpipe", dp=2, dp_mode="fsdp"), DP_BATCHES),
    },
    4: {
        **{f"pp4-{s}": (_pipe(4, s, "except_last"), PIPELINE_BATCHES) for s in SCHEDULES},
        **{f"dp2xpp2-{s}-ddp": (_pipe(2, s, dp=2), DP_BATCHES) for s in ("gpipe", "1f1b", "interleaved-1f1b")},
        "dp2xpp2-interleaved-1f1b-fsdp": (_pipe(2, "interleaved-1f1b", dp=2, dp_mode="fsdp"), DP_BATCHES),
    },
}
# The causal decoder: (hidden states, boolean padding mask) cross every stage boundary; the loss is per token
# with padding ignored, over micro-batches holding unequal numbers of tokens (and replicas too, with dp=2).
# "gpt-mask-input-*": the first stage takes two inputs (tokens, padding mask).
# "table-*": a float position table made from the input crosses stages without a gradient.
# "lengths": batches of 4 sequence lengths with room for 2 schedules: shapes are evicted and rebuilt, each
# length exact, and the schedules (and their stages' buffers) held stay within the bound.
GPT_BATCHES = {
    "pipe": (PIPELINE_BATCHES, None),
    "dp": (DP_BATCHES, None),
    "lengths": ([8, 8, 6, 8, 8, 8], [12, 5, 9, 5, 12, 7]),
}
GPT_CASES = {
    2: {
        **{f"gpt-pp2-{s}": (_pipe(2, s, "except_last"), "pipe") for s in ("gpipe", "1f1b", "interleaved-1f1b")},
        "gpt-pp2-1f1b-lengths": (_pipe(2, "1f1b", shape_cache=2), "lengths"),
        "gpt-mask-input-pp2-interleaved-1f1b": (_pipe(2, "interleaved-1f1b"), "pipe"),
        **{f"table-pp2-{s}": (_pipe(2, s), "pipe") for s in ("1f1b", "interleaved-1f1b")},
    },
    4: {
        **{f"gpt-pp4-{s}": (_pipe(4, s), "pipe") for s in ("gpipe", "1f1b", "interleaved-1f1b")},
        "gpt-dp2xpp2-1f1b-fsdp": (_pipe(2, "1f1b", dp=2, dp_mode="fsdp"), "dp"),
        "gpt-mask-input-dp2xpp2-gpipe-ddp": (_pipe(2, "gpipe", dp=2), "dp"),
    },
}
# the memory modes on the decoder: selective recomputation with offloading inside an interleaved pipeline, and
# keeping every other matrix product (torchtitan's op-level policy); FSDP's
# "auto" (resharding at pp 1) with selective recomputation; resharding, sharded gradients and offloading in dp x pp
GPT_MEMORY_CASES = {
    2: {
        "gpt-pp2-interleaved-1f1b-selective-offload": (
            _pipe(2, "interleaved-1f1b", "except_last", unit="selective", offload=True), "pipe"),
        "gpt-dp2-fsdp-auto-selective": (
            _pipe(1, "gpipe", "always", dp=2, dp_mode="fsdp", unit="selective", fsdp_reshard="auto"),
            "dp"),
        "gpt-pp2-1f1b-selective-alternate": (_pipe(2, "1f1b", "always", unit="selective", matmuls="alternate"),
                                             "pipe"),
    },
    4: {
        "gpt-dp2xpp2-1f1b-fsdp-reshard-offload": (
            _pipe(2, "1f1b", dp=2, dp_mode="fsdp", fsdp_reshard="always", offload=True), "dp"),
    },
}
ALL_CASES = {world: {**WORLD_CASES[world], **MEMORY_CASES[world], **GPT_CASES[world], **GPT_MEMORY_CASES[world]}
             for world in WORLD_CASES}


def _batch_set(name: str, key):
    """(reference key, model name, batches) of a case."""
    if name.startswith("table-"):
        return ("table", key), "table", make_float_batches(GPT_BATCHES[key][0])
    if name.startswith("gpt-mask-input-"):  # the mask is a second input of the first stage
        sizes, widths = GPT_BATCHES[key]
        return ("gpt-mask-input", key), "gpt-mask-input", with_mask_input(make_token_batches(sizes, widths=widths))
    if name.startswith("gpt-"):
        sizes, widths = GPT_BATCHES[key]
        return ("gpt", key), "gpt", make_token_batches(sizes, widths=widths)
    return ("classifier", tuple(key)), "classifier", make_batches(key)


def test_offloading_cases_moved_activations(records):
    """The offloading cases ran the offloading path (activations copied out), not a silent no-op."""
    for name in ("pp2-1f1b-offload", "gpt-pp2-interleaved-1f1b-selective-offload",
                 "gpt-dp2xpp2-1f1b-fsdp-reshard-offload"):
        assert all(record["offloaded"] > 0 for record in records[name]), name


def test_schedules_per_shape_stay_within_the_cache_bound(records):
    for record in records["gpt-pp2-1f1b-lengths"]:
        cached, evictions, live_stages = record["cache"]
        assert cached == 2 and evictions >= 6  # 12 (run, shape) keys over the run, training and evaluation
        assert live_stages == 2  # evicted schedules' PipelineStages are freed: one per cached schedule


@pytest.fixture(scope="module")
def references():
    refs = {}
    for world_cases in ALL_CASES.values():
        for name, (_, key) in world_cases.items():
            ref_key, model, batches = _batch_set(name, key)
            if ref_key not in refs:
                refs[ref_key] = reference_run(batches, model)
    return refs


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """name -> per-rank records, for every case of every world size (one job per world size)."""
    cases = {}
    for world, world_cases in ALL_CASES.items():
        runs = {}
        for name, (parallel, key) in world_cases.items():
            _, model, batches = _batch_set(name, key)
            runs[name] = (parallel, batches, model)
        cases.update(parallel_runs(world, runs, tmp_path_factory.mktemp(f"world{world}")))
    return cases


@pytest.mark.parametrize("name", [name for world_cases in ALL_CASES.values() for name in world_cases])
def test_matches_single_process(name, records, references):
    key = next(c[1] for w in ALL_CASES.values() for n, c in w.items() if n == name)
    ref_key, _, _ = _batch_set(name, key)
    assert_parity(references[ref_key], records[name], rtol=RTOL, atol=ATOL)

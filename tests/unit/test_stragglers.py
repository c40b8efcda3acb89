"""Stragglers, without processes: the comparison across the replicas of one stage position, the compute seconds of a
recorded step, the flag's check, and the JSON record that names them (and leaves the field out otherwise)."""

from __future__ import annotations

import pytest

from pipetrain.errors import ConfigError
from pipetrain.logs.config import LogConfig
from pipetrain.logs.records import StepRecord, record_dict
from pipetrain.logs.stragglers import (RankTime, Straggler, StragglerWatch, compute_seconds, straggler_line,
                                      stragglers)


def _times(seconds: dict[int, float], pp: int = 2) -> list[RankTime]:
    """Rank r of a dp x pp mesh (pp innermost) computed `seconds[r]`."""
    return [RankTime(r, f"node{r // 2}", (r % pp, 0), r // pp, s) for r, s in seconds.items()]


def test_the_slow_replica_of_a_stage_is_named_and_no_other():
    # stage 0: ranks 0, 2, 4, 6; stage 1: ranks 1, 3, 5, 7 — rank 5 is slow; stage 1 is slower than stage 0 as a
    # whole (more blocks): ranks are compared within their stage only
    times = _times({0: 0.10, 2: 0.11, 4: 0.10, 6: 0.12, 1: 0.30, 3: 0.31, 5: 0.50, 7: 0.29})
    (found,) = stragglers(times, 1.3)
    assert (found.rank, found.host, found.stage, found.dp) == (5, "node2", 1, 2)
    assert found.median_s == pytest.approx(0.30) and found.ratio == pytest.approx(0.50 / 0.30)


def test_two_replicas_compare_with_the_other_not_with_their_mean():
    # the mean of 0.1 and 0.2 is 0.15: 0.2 would stand only 1.33x above it; against the other replica, 2x
    (found,) = stragglers(_times({0: 0.1, 1: 0.2}, pp=1), 1.5)
    assert found.rank == 1 and found.ratio == pytest.approx(2.0)


def test_below_the_factor_or_the_noise_floor_nobody_is_named():
    assert stragglers(_times({0: 0.10, 1: 0.125}, pp=1), 1.3) == []  # 1.25x
    assert stragglers(_times({0: 0.002, 1: 0.006}, pp=1), 1.3) == []  # 3x, but 4 ms: scheduling noise
    assert [s.rank for s in stragglers(_times({0: 0.002, 1: 0.006}, pp=1), 1.3, min_excess_s=0.001)] == [1]
    assert stragglers(_times({0: 0.5, 1: 0.1}, pp=2), 1.3) == []  # one rank per stage: no peers


def test_compute_seconds_leave_out_waits_and_the_last_backward():
    ms = 1_000_000
    records = [("F", 0, 10 * ms, 0, 1, 0), ("F", 10 * ms, 20 * ms, 0, 1, 1), ("wait", 20 * ms, 90 * ms, 0, -1, -1),
               ("B", 90 * ms, 110 * ms, 0, 1, 0), ("B", 110 * ms, 400 * ms, 0, 1, 1),  # the DDP all-reduce's
               ("dp", 400 * ms, 500 * ms, 0, -1, -1), ("step", 0, 500 * ms, 0, -1, -1)]
    assert compute_seconds(records) == pytest.approx(0.040)


def test_the_record_and_the_line_name_the_rank_and_its_host():
    s = Straggler(rank=3, host="node1", stage=1, dp=1, seconds=0.4, median_s=0.2, ratio=2.0)
    base = dict(step=20, epoch=1, loss=1.0, lr=1e-3, samples=16, step_time_s=0.5, samples_per_s=32.0)
    assert "stragglers" not in record_dict(StepRecord(**base))
    named = record_dict(StepRecord(**base, stragglers=(s.as_dict(),)))
    assert named["stragglers"] == (s.as_dict(),)  # a list once in JSON
    assert straggler_line(s.as_dict(), 20, 1.3) == (
        "straggler at step 20: rank 3 on node1 (stage 1, replica 1) computed its step in 0.400 s, 2.0x the median "
        "0.200 s of stage 1's other replicas (--straggler-factor 1.3)")


@pytest.mark.parametrize("factor", [1.0, 0.5, -2.0])
def test_a_factor_of_one_or_less_is_refused(factor):
    with pytest.raises(ConfigError, match="--straggler-factor must be above 1"):
        LogConfig(straggler_factor=factor)


def test_without_a_process_group_or_replicas_nothing_is_measured():
    watch = StragglerWatch(None, every=2, factor=1.3, dp=2, dp_rank=0, pp_rank=0)
    assert not watch.on and not watch.due(2)
    with watch.measure(2):
        pass
    assert watch.compare(2) == []

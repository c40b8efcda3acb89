"""Checkpoint folders, the watchdog's message and the stderr filter of quiet DDP: plain files, no process group."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipetrain.checkpoint.folders import (
    CheckpointMeta,
    commit,
    complete_checkpoints,
    damaged_hint,
    final_folder,
    latest_checkpoint,
    partial_folder,
    probe_writable,
    prune,
    read_meta,
    write_meta,
)
from pipetrain.errors import ConfigError
from pipetrain.launch.watchdog import stuck_message
from pipetrain.parallel.quiet_ddp import stderr_without


def _meta(step: int) -> CheckpointMeta:
    return CheckpointMeta(step=step, model="m", fingerprint="f", layout={}, world_size=1, config={}, extras={})


def _checkpoint(directory: Path, step: int, *, committed: bool = True) -> Path:
    partial = partial_folder(directory, step)
    partial.mkdir(parents=True)
    (partial / "__0_0.distcp").write_bytes(b"shard")
    if not committed:
        return partial
    write_meta(partial, _meta(step))
    commit(partial, final_folder(directory, step))
    return final_folder(directory, step)


def test_latest_complete_checkpoint_wins_and_partial_ones_are_ignored(tmp_path):
    _checkpoint(tmp_path, 4)
    _checkpoint(tmp_path, 12)
    _checkpoint(tmp_path, 16, committed=False)  # a save killed before its commit
    (tmp_path / "step-00000020").mkdir()  # renamed by hand, without metadata: not a checkpoint
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-00000004", "step-00000012"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000012"
    assert read_meta(latest_checkpoint(tmp_path)).step == 12


def test_prune_removes_partial_folders_and_keeps_the_newest(tmp_path):
    for step in (4, 8, 12):
        _checkpoint(tmp_path, step)
    _checkpoint(tmp_path, 16, committed=False)
    removed = prune(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == ["step-00000004", "step-00000016.partial"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000008", "step-00000012"]


def test_saving_a_step_again_replaces_it(tmp_path):
    _checkpoint(tmp_path, 4)
    partial = _checkpoint(tmp_path, 4, committed=False)
    write_meta(partial, CheckpointMeta(**{**_meta(4).__dict__, "extras": {"again": True}}))
    commit(partial, final_folder(tmp_path, 4))
    assert read_meta(final_folder(tmp_path, 4)).extras == {"again": True}
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000004"]


def test_read_meta_names_what_is_wrong(tmp_path):
    with pytest.raises(ConfigError, match="not a pipetrain checkpoint"):
        read_meta(tmp_path)
    (tmp_path / "pipetrain.json").write_text('{"format": "other/2"}')
    with pytest.raises(ConfigError, match="has format 'other/2'"):
        read_meta(tmp_path)
    (tmp_path / "pipetrain.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        read_meta(tmp_path)


def test_probe_writable_refuses_a_folder_that_cannot_be_written(tmp_path):
    probe_writable(tmp_path / "new" / "ckpt")
    assert (tmp_path / "new" / "ckpt").is_dir() and not list((tmp_path / "new" / "ckpt").iterdir())
    with pytest.raises(ConfigError, match="cannot write checkpoints to --save-dir '/proc/x'"):
        probe_writable(Path("/proc/x"))


def test_watchdog_names_the_silent_rank_then_the_rank_behind():
    silent = stuck_message(me=0, step=7, timeout_s=30, steps={0: 7, 1: 7}, silent={1: 40.2})
    assert silent.startswith("rank 1 (last finished step 7, silent for 40 s) stopped responding")
    assert "rank 0 waited 30 s (--step-timeout) for step 8" in silent
    behind = stuck_message(me=0, step=7, timeout_s=30, steps={0: 7, 1: 6, 2: 7}, silent={})
    assert behind.startswith("rank(s) 1 stuck at step 7 while others finished it")
    both = stuck_message(me=1, step=3, timeout_s=30, steps={0: 3, 1: 3}, silent={})
    assert both.startswith("every rank is stuck in step 4")


def test_stderr_without_drops_only_the_named_line(capfd):
    with stderr_without("find_unused_parameters=True was specified"):
        os.write(2, b"[W reducer.cpp] Warning: find_unused_parameters=True was specified in DDP constructor\n")
        os.write(2, b"something else\n")
    assert capfd.readouterr().err == "something else\n"


def test_a_damaged_checkpoint_names_the_older_complete_ones(tmp_path):
    first = _checkpoint(tmp_path, 4)
    assert "no older complete one" in damaged_hint(first)
    _checkpoint(tmp_path, 8)
    newest = _checkpoint(tmp_path, 12)
    (newest / "pipetrain.json").write_text("{ torn")
    with pytest.raises(ConfigError) as raised:
        read_meta(newest)
    assert "step-00000004, step-00000008" in str(raised.value)
    assert f"--resume {tmp_path / 'step-00000008'}" in str(raised.value)


def test_a_crash_between_the_two_renames_of_a_resave_keeps_that_steps_checkpoint(tmp_path, monkeypatch):
    """A step saved again (resumed, then stopped at once) is committed by two renames; a crash between them used to
    leave the only copy under a `.partial` name that the next save deleted (fails on main)."""
    _checkpoint(tmp_path, 1)
    _checkpoint(tmp_path, 2)
    again = partial_folder(tmp_path, 2)
    again.mkdir()
    (again / "__0_0.distcp").write_bytes(b"new shard")
    write_meta(again, _meta(2))
    renames, rename = [], os.rename

    def crash_on_the_second(source, target):
        renames.append(target)
        if len(renames) == 2:
            raise KeyboardInterrupt  # the job ends between the renames (a signal, a power cut)
        rename(source, target)

    monkeypatch.setattr("pipetrain.checkpoint.folders.os.rename", crash_on_the_second)
    with pytest.raises(KeyboardInterrupt):
        commit(again, final_folder(tmp_path, 2))
    monkeypatch.undo()
    assert not final_folder(tmp_path, 2).exists()
    assert latest_checkpoint(tmp_path).name.startswith("step-00000002")  # a resume reads the replaced copy
    prune(tmp_path, keep=None)  # what the next save does first
    assert latest_checkpoint(tmp_path) == final_folder(tmp_path, 2)
    assert read_meta(final_folder(tmp_path, 2)).step == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001", "step-00000002"]
    # a replacement that completed leaves no copy behind
    _checkpoint(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001", "step-00000002"]
    assert (final_folder(tmp_path, 2) / "__0_0.distcp").read_bytes() == b"shard"

"""The tokenization cache shared by nodes whose file locks do not hold across them (NFS `local_lock`, Lustre without
flock) and whose processes may have equal pids (containers): each builder builds in a folder of its own, named by
host, pid and a random id, so a second builder of the same key never deletes or writes into the first's build;
whichever renames first wins, the other removes its own folder."""

from __future__ import annotations

import contextlib
import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("datasets")

from pipetrain.data import cache as data_cache  # noqa: E402
from pipetrain.data.fields import RowFormat  # noqa: E402
from tests.hf_folders import tiny_tokenizer  # noqa: E402


def test_two_builders_of_the_same_key_with_the_same_pid_and_no_lock_leave_one_complete_cache(tmp_path, monkeypatch):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"text": f"row {i}: the cat sat on the mat"}) + "\n" for i in range(30)))
    root, tokenizer = tmp_path / "cache", tiny_tokenizer()
    monkeypatch.setattr(data_cache.os, "getpid", lambda: 4242)  # two containers, one pid
    import filelock

    monkeypatch.setattr(filelock, "FileLock", lambda path: contextlib.nullcontext())  # a lock that does not lock
    build, seen = data_cache._build, {}

    def first_builder_interrupted(datasets, path, fmt, tok, name, data_format, files, building, key, procs):
        """Builder A starts, writes into its folder, and the second node's builder B runs the whole build."""
        building.mkdir(parents=True)
        (building / "a-was-here").write_text("")
        if not seen:
            seen["a"] = building
            monkeypatch.setattr(data_cache, "_build", build)
            seen["b"] = tokenize(), sorted(p.name for p in root.iterdir())
            assert (building / "a-was-here").exists(), "builder B deleted builder A's build folder"
        return build(datasets, path, fmt, tok, name, data_format, files, building, key, procs)

    def tokenize():
        return data_cache.tokenize_cached(data, RowFormat(), tokenizer, tokenizer_name="tiny", tokenizer_key="k",
                                          cache_root=root)

    monkeypatch.setattr(data_cache, "_build", first_builder_interrupted)
    a = tokenize()
    b, during = seen["b"]
    assert len([name for name in during if name.endswith(".partial")]) == 1  # A's, still building
    left = [p.name for p in root.iterdir()]
    assert len(left) == 1 and left[0].startswith("tokens-"), left  # B's cache; A's folder and every lock gone
    assert a.rows["input_ids"] == b.rows["input_ids"] and len(a.rows) == 30
    assert data_cache.build_folder_name("k") != data_cache.build_folder_name("k")

"""Answer-only labels stay exact under a layout: chat rows whose answers hold different numbers of trained tokens,
trained at pp=2 (1F1B, micro-batches of unequal trained-token counts, a remainder micro-batch) and dp=2, match
the unsplit model on the same global batches (`pipetrain check`'s own tolerances: the loss is the global sum of
trained-token losses over the global count of trained tokens, whatever the split)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("datasets")

from pipetrain.check import run_checks  # noqa: E402
from pipetrain.config import ParallelConfig, PipelineConfig  # noqa: E402
from pipetrain.data import cache as data_cache  # noqa: E402
from pipetrain.train.config import TrainConfig, load_data  # noqa: E402
from tests.hf_folders import tiny_model_folder  # noqa: E402


def _chat(i: int) -> dict:
    answer = " ".join(["yes"] * (1 + i % 5))  # 1 to 5 words: micro-batches train different token counts
    return {"messages": [{"role": "user", "content": f"Question {i}: is it good?"},
                         {"role": "assistant", "content": answer}]}


def test_chat_rows_train_the_same_split_over_pipeline_and_replicas(tmp_path, monkeypatch):
    monkeypatch.setattr(data_cache, "default_cache_root", lambda: tmp_path / "cache")
    folder = tiny_model_folder(tmp_path / "model", chat=True)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(_chat(i)) + "\n" for i in range(40)))

    def config(dp: int, pp: int, chunks: int, batch: int) -> TrainConfig:
        pipeline = PipelineConfig(pp=pp, schedule="1f1b" if pp > 1 else "gpipe", n_microbatches=chunks)
        return TrainConfig(parallel=ParallelConfig(dp=dp, pipeline=pipeline), workload="hf", model_dir=folder,
                           data=data, seq_len=64, batch_size=batch, epochs=1, progress=False)

    layouts = {"pp2-1f1b-5-rows-in-2": config(1, 2, 2, 5), "dp2-ddp": config(2, 1, 2, 6)}
    jobs = [(c, load_data(c)[0]) for c in layouts.values()]
    assert jobs[0][1].supervised and "assistant turns trained" in jobs[0][1].source
    for name, report in zip(layouts, run_checks(jobs, steps=2, work_dir=tmp_path)):
        text = "\n".join(report.lines())
        print(name, text, sep="\n")
        assert report.passed, text

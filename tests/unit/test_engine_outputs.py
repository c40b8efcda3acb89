"""The last stage returns its full-batch outputs only when asked (`keep_outputs`), and reads its metrics back to the
host once per step (on CUDA each read is a synchronisation): one in-process rank (gloo)."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

from pipetrain.errors import ConfigError
from pipetrain.pipeline import IGNORE_INDEX, TokenCrossEntropy

from pipetrain.blocks import ModuleListModel
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.launch.env import free_port
from pipetrain.launch.ranks import RankSpec
from pipetrain.session import close_session, open_session


def test_outputs_only_when_asked():
    model = ModuleListModel([nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)], example_input=torch.zeros(1, 4))
    session = open_session(RankSpec(0, 0, 1, "127.0.0.1", free_port(), "cpu"), model,
                           ParallelConfig(pipeline=PipelineConfig(pp=1, schedule="gpipe", n_microbatches=2)))
    try:
        x, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
        kept = session.engine.step(x, y)
        assert kept.outputs is not None and kept.outputs.shape == (6, 3)  # the public default: kept
        session.engine.keep_outputs = False
        dropped = session.engine.step(x, y)
        assert dropped.outputs is None and dropped.count == 6 and dropped.accuracy is not None
    finally:
        close_session()


#: The tensor methods that copy a value to the host (a CUDA synchronisation each).
_HOST_READS = ("item", "tolist", "__int__", "__float__", "__bool__")


def test_a_token_loss_step_reads_the_device_once(monkeypatch):
    model = ModuleListModel([nn.Embedding(10, 8), nn.Linear(8, 10)], example_input=torch.zeros(1, 5, dtype=torch.long))
    session = open_session(RankSpec(0, 0, 1, "127.0.0.1", free_port(), "cpu"), model,
                           ParallelConfig(pipeline=PipelineConfig(pp=1, schedule="gpipe", n_microbatches=2)),
                           loss_fn=TokenCrossEntropy())
    try:
        x, y = torch.randint(1, 10, (4, 5)), torch.randint(0, 10, (4, 5))
        y[0, 3:] = IGNORE_INDEX
        session.engine.step(x, y)  # the first step builds the schedule
        reads: collections.Counter = collections.Counter()
        with monkeypatch.context() as patched:
            for name in _HOST_READS:
                original = getattr(torch.Tensor, name)

                def counted(self, *args, _name=name, _original=original, **kwargs):
                    reads[_name] += 1
                    return _original(self, *args, **kwargs)

                patched.setattr(torch.Tensor, name, counted)
            result = session.engine.step(x, y)
        assert dict(reads) == {"tolist": 1}  # was 3 int() + 2 item() + 1 tolist()
        assert result.count == 18 and result.perplexity is not None
        with pytest.raises(ConfigError, match="every target of this batch is padding"):
            session.engine.step(x, torch.full_like(y, IGNORE_INDEX))
    finally:
        close_session()


#: the classes of the two-block token model below: 160 KB of fp32 logits per micro-batch of 2 x 5 tokens
VOCAB = 4096


def _logits_session(schedule: str):
    """One rank's session (pp 1, 4 micro-batches under `schedule`) of an embedding and a head over `VOCAB` classes,
    with the token loss."""
    torch.manual_seed(0)
    model = ModuleListModel([nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB)],
                            example_input=torch.zeros(1, 5, dtype=torch.long))
    return open_session(RankSpec(0, 0, 1, "127.0.0.1", free_port(), "cpu"), model,
                        ParallelConfig(pipeline=PipelineConfig(pp=1, schedule=schedule, n_microbatches=4)),
                        loss_fn=TokenCrossEntropy())


def test_metrics_summed_per_micro_batch_match_the_whole_batch_and_drop_the_logits():
    """Training sums each micro-batch's loss total, count and correct tokens as its loss is computed: the step's loss
    and accuracy are the whole batch's (fp32 sums in float64: to 1e-6 relative; counts exact), whether the outputs
    are kept or not; dropped, the schedule keeps no logits: the step's peak of live bytes (a dispatch mode counting
    storages, 1F1B at pp 1, 4 micro-batches of 2 x 5 tokens over 4096 classes: 160 KB of logits each) falls by at
    least two micro-batches' logits and nothing of them is left after the step; kept, the merged outputs alone."""
    from pipetrain.compat.live import LiveBytes

    vocab = VOCAB
    session = _logits_session("1f1b")
    try:
        x, y = torch.randint(1, vocab, (8, 5)), torch.randint(0, vocab, (8, 5))
        y[0, 3:] = IGNORE_INDEX
        y[1:4, :] = torch.randint(0, 8, (3, 5))  # some tokens right
        engine, results, peaks, left = session.engine, {}, {}, {}
        for keep in (True, False):
            engine.keep_outputs = keep
            engine.step(x, y)  # the schedule is built, the gradients exist
            with LiveBytes() as live:
                results[keep] = engine.step(x, y)
                left[keep] = live.bytes
            peaks[keep] = live.peak
        with torch.no_grad():
            logits = engine.modules[0](x)  # the stage (both blocks) with the same weights: no optimizer step ran
        mask = y != IGNORE_INDEX
        loss = torch.nn.functional.cross_entropy(logits[mask], y[mask], reduction="mean").item()
        accuracy = (logits.argmax(-1)[mask] == y[mask]).float().mean().item()
        for keep in (True, False):
            assert results[keep].loss == pytest.approx(loss, rel=1e-6)
            assert results[keep].accuracy == pytest.approx(accuracy, abs=1e-12)
            assert results[keep].count == int(mask.sum())
        assert results[True].loss == results[False].loss and results[True].outputs.shape == (8, 5, vocab)
        micro_batch_logits = 2 * 5 * vocab * 4
        assert peaks[True] - peaks[False] >= 2 * micro_batch_logits
        # kept: their merged copy only (the last stage's loss head holds each micro-batch's outputs for the step alone)
        assert 4 * micro_batch_logits <= left[True] - left[False] < 5 * micro_batch_logits
    finally:
        close_session()


def test_the_last_stage_keeps_its_loss_not_its_logits_for_the_backward():
    """The last stage computes its loss in its forward (`pipeline.head`): torch's stage keeps the loss, a scalar, to
    the backward, and the logits die with the loss's forward. GPipe at pp 1, 4 micro-batches of 2 x 5 tokens over
    4096 classes (160 KB of fp32 logits each), outputs not kept: after the 4 forwards the stage holds each one's
    log-softmax (4 logits-sized tensors), then the first backward's 2 temporaries and the blocks' fresh gradients
    (1.6 logits): measured 7.5 logits above the step's start; holding the logits for the backward too (torch's
    `fwd_cache`, before the loss moved into the stage) measured 10.8."""
    from pipetrain.compat.live import LiveBytes

    vocab = VOCAB
    session = _logits_session("gpipe")
    try:
        x, y = torch.randint(1, vocab, (8, 5)), torch.randint(0, vocab, (8, 5))
        engine = session.engine
        engine.keep_outputs = False
        engine.step(x, y)  # the schedule is built, the gradients exist
        with LiveBytes() as live:
            result = engine.step(x, y)
        logits = 2 * 5 * vocab * 4
        assert result.outputs is None and result.count == 40
        assert 6 * logits <= live.peak < 8 * logits
    finally:
        close_session()

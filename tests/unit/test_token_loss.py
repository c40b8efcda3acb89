"""Losses as sums and counts: a token cross-entropy with padding, normalised over the global batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipetrain.pipeline.loss import IGNORE_INDEX, SampleMeanLoss, TokenCrossEntropy, as_loss


def _batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 5, 7, generator=gen)
    targets = torch.randint(0, 7, (6, 5), generator=gen)
    lengths = torch.tensor([5, 1, 3, 2, 5, 4])
    targets[torch.arange(5)[None, :] >= lengths[:, None]] = IGNORE_INDEX
    return logits, targets


def test_token_loss_sums_over_non_padding_tokens():
    logits, targets = _batch()
    loss = TokenCrossEntropy()
    assert loss.count(targets) == 20
    mean = F.cross_entropy(logits.reshape(-1, 7), targets.reshape(-1), ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(loss.total(logits, targets) / loss.count(targets), mean)
    expected = ((logits.argmax(-1) == targets) & (targets != IGNORE_INDEX)).sum().item()
    assert loss.correct(logits, targets) == expected


def test_micro_batch_totals_over_the_global_count_give_the_global_mean():
    logits, targets = _batch()
    loss = TokenCrossEntropy()
    global_mean = loss.total(logits, targets) / loss.count(targets)
    parts = [slice(0, 2), slice(2, 4), slice(4, 6)]  # 6, 5 and 9 tokens
    exact = sum(loss.total(logits[p], targets[p]) for p in parts) / loss.count(targets)
    torch.testing.assert_close(exact, global_mean)
    # what a mean of per-micro-batch means would give instead: not the same number (so the parity test can fail)
    naive = sum(loss.total(logits[p], targets[p]) / loss.count(targets[p]) for p in parts) / len(parts)
    assert abs(naive.item() - global_mean.item()) > 1e-3


def test_a_mean_loss_function_is_counted_per_sample_with_accuracy_for_class_logits():
    loss = as_loss(F.cross_entropy)
    assert isinstance(loss, SampleMeanLoss) and not loss.perplexity
    logits, labels = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0]]), torch.tensor([0, 0, 0])
    torch.testing.assert_close(loss.total(logits, labels), F.cross_entropy(logits, labels) * 3)
    assert (loss.count(labels), loss.correct(logits, labels)) == (3, 2)
    assert as_loss(F.mse_loss).correct(torch.zeros(3, 1), torch.zeros(3, 1)) is None


def test_a_token_loss_is_used_as_it_is():
    loss = TokenCrossEntropy(ignore_index=0)
    assert as_loss(loss) is loss and loss.perplexity

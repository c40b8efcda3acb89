"""Answer accuracy without processes: normalisation, exact match, the running score, and where a row's prompt and
reference answer are among its tokens."""

from __future__ import annotations

import torch

from pipetrain.evaluate.answers import AnswerScore, cut_at, exact_match, normalize, split_row


def test_normalize_lowercases_drops_punctuation_and_collapses_whitespace():
    assert normalize("  The Answer:\tPOSITIVE!! ") == "the answer positive"
    assert normalize("«Très» bien…") == "très bien"
    assert normalize("ﬁne") == "fine"  # NFKC: the ligature is two letters
    assert normalize("...") == ""


def test_exact_match_after_normalisation_only():
    assert exact_match(" Positive.", "positive")
    assert exact_match("New  York", "new york!")
    assert not exact_match("positive review", "positive")
    assert not exact_match("negative", "positive")


def test_the_score_counts_and_keeps_a_few_examples():
    score = AnswerScore(keep=2)
    for answer, reference in [("Yes", "yes."), ("no", "yes"), ("4", "4"), ("x", "y")]:
        score.add(answer, reference)
    assert (score.correct, score.total, score.accuracy) == (2, 4, 0.5)
    assert score.examples == [("Yes", "yes.", True), ("no", "yes", False)]
    assert AnswerScore().accuracy is None


def test_split_row_takes_the_untrained_prefix_and_the_first_trained_run():
    tokens = torch.tensor([5, 6, 7, 8, 9, 10, 11])
    trained = torch.tensor([0, 0, 0, 1, 1, 0, 1], dtype=torch.bool)  # a chat: a second assistant turn at the end
    assert split_row(tokens, trained) == ([5, 6, 7], [8, 9])
    assert split_row(tokens[:5], trained[:5]) == ([5, 6, 7], [8, 9])
    assert split_row(tokens, torch.zeros(7, dtype=torch.bool)) is None  # nothing trained
    assert split_row(tokens, torch.ones(7, dtype=torch.bool)) is None  # no prompt


def test_cut_at_the_first_stop_token():
    assert cut_at([4, 5, 0, 6], {0, 2}) == [4, 5]
    assert cut_at([4, 5], {0}) == [4, 5]
    assert cut_at([2, 4], {2}) == []

"""Evaluation of a causal LM: held-out loss and perplexity through the training pipeline's evaluation path, and for
instruction data the exact-match accuracy of generated answers (`pipetrain eval`; docs/generate.md)."""

from pipetrain.evaluate.answers import AnswerScore, exact_match, normalize

__all__ = ["AnswerScore", "exact_match", "normalize"]

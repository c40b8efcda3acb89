"""The language-model workload: the GPT-style causal decoder on a token corpus, per-token loss with padding."""

from __future__ import annotations

from collections.abc import Iterator

from pipetrain.pipeline.loss import TokenCrossEntropy
from pipetrain.workloads.corpus import TokenCorpus, load_text, synthetic_corpus, token_batches
from pipetrain.workloads.gpt import GPT_PRESETS, GPTModel
from pipetrain.workloads.imdb import num_batches
from pipetrain.workloads.registry import Batch, DataRequest, Workload

__all__ = ["LanguageModelWorkload"]


class LanguageModelWorkload(Workload):
    """Next-token prediction: `GPTModel`, token cross-entropy over non-padding tokens, token accuracy and
    perplexity; `bucket` batches documents of similar lengths."""

    name = "lm"
    summary = "GPT-style causal decoder, next-token loss (synthetic corpus without --data)"
    presets = GPT_PRESETS
    metrics = ("accuracy", "perplexity")
    data_help = "plain-text file (paragraphs split by blank lines) or folder of .txt files"
    buckets = True

    def model(self, preset: str) -> GPTModel:
        self.check_preset(preset)
        return GPTModel(GPT_PRESETS[preset])

    def load_data(self, request: DataRequest) -> tuple[TokenCorpus, TokenCorpus]:
        config = GPT_PRESETS[request.preset]
        if request.path is not None:
            return load_text(request.path, seq_len=config.seq_len, vocab_size=config.vocab_size)
        return synthetic_corpus(num_train=request.train_samples, num_test=request.test_samples,
                                seq_len=config.seq_len, vocab_size=config.vocab_size, seed=request.seed)

    def batches(
        self, dataset: TokenCorpus, batch_size: int, *, shuffle: bool, seed: int, epoch: int,
        replica: int, replicas: int, bucket: bool = False,
    ) -> Iterator[Batch]:
        return token_batches(dataset, batch_size, shuffle=shuffle, seed=seed, epoch=epoch, replica=replica,
                             replicas=replicas, bucket=bucket)

    def num_batches(self, dataset: TokenCorpus, batch_size: int, *, replicas: int) -> int:
        return num_batches(len(dataset), batch_size, replicas=replicas)

    def loss(self) -> TokenCrossEntropy:
        return TokenCrossEntropy()

    def describe_data(self, dataset: TokenCorpus) -> str:
        return "synthetic token corpus" if dataset.synthetic else "text"

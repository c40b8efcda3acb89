"""The `hf` workload: a Hugging Face causal LM (Llama family, GPT-2) trained on the language-model corpus.

`pipetrain train --workload hf --preset llama-tiny` (or `gpt2-tiny`, `llama-cpu`, `gpt2-cpu`) builds the model
from a small `transformers` config through `HFCausalLM` (each rank only its own layers) and trains it on the
`lm` workload's data: the synthetic token corpus, or `--data` text. The targets are the next tokens
(padding -100), so the loss is the token cross-entropy of the logits as they are. For a model of your own
(a local folder with config.json and safetensors weights), register a workload in Python:
`register("my-llama", lambda: HFWorkload(folder="/models/my-llama", seq_len=512))`.
Needs the optional extra: `pip install 'pipetrain[hf]'`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipetrain.workloads.corpus import TokenCorpus, load_text, synthetic_corpus
from pipetrain.workloads.hf_causal_lm import HFCausalLM, require_transformers
from pipetrain.workloads.language_model import LanguageModelWorkload
from pipetrain.workloads.registry import DataRequest

__all__ = ["HFPreset", "HF_PRESETS", "HFWorkload"]


@dataclass(frozen=True)
class HFPreset:
    """A transformers config class name, its keyword arguments, and the longest sequence trained on."""

    config_class: str
    kwargs: dict[str, Any]
    seq_len: int

    def config(self) -> Any:
        return getattr(require_transformers(), self.config_class)(**self.kwargs)


_GPT2_QUIET = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "tie_word_embeddings": False,
               "bos_token_id": 0, "eos_token_id": 0}
HF_PRESETS: dict[str, HFPreset] = {
    "llama-tiny": HFPreset("LlamaConfig", {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
                                           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                                           "max_position_embeddings": 64}, seq_len=32),
    "gpt2-tiny": HFPreset("GPT2Config", {"vocab_size": 96, "n_embd": 32, "n_layer": 4, "n_head": 4,
                                         "n_positions": 64, **_GPT2_QUIET}, seq_len=32),
    "llama-cpu": HFPreset("LlamaConfig", {"vocab_size": 1024, "hidden_size": 64, "intermediate_size": 172,
                                          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                                          "max_position_embeddings": 256}, seq_len=128),
    "gpt2-cpu": HFPreset("GPT2Config", {"vocab_size": 1024, "n_embd": 64, "n_layer": 4, "n_head": 4,
                                        "n_positions": 256, **_GPT2_QUIET}, seq_len=128),
}


class HFWorkload(LanguageModelWorkload):
    """Next-token prediction with a transformers causal LM: a preset's config, or a local checkpoint `folder`."""

    name = "hf"
    summary = "a Hugging Face causal LM (Llama, GPT-2) from a small config; needs pip install 'pipetrain[hf]'"
    presets = HF_PRESETS

    def __init__(self, folder: str | Path | None = None, seq_len: int = 128) -> None:
        self.folder, self.seq_len = folder, seq_len

    def check_preset(self, preset: str) -> None:
        if self.folder is None:
            super().check_preset(preset)

    def model(self, preset: str) -> HFCausalLM:
        if self.folder is not None:
            return HFCausalLM.from_folder(self.folder, seq_len=self.seq_len)
        self.check_preset(preset)
        spec = HF_PRESETS[preset]
        return HFCausalLM(spec.config(), seq_len=spec.seq_len)

    def load_data(self, request: DataRequest) -> tuple[TokenCorpus, TokenCorpus]:
        model = self.model(request.preset)
        vocab, seq_len = model.config.vocab_size, model.seq_len
        if request.path is not None:
            return load_text(request.path, seq_len=seq_len, vocab_size=vocab)
        return synthetic_corpus(num_train=request.train_samples, num_test=request.test_samples,
                                seq_len=seq_len, vocab_size=vocab, seed=request.seed)

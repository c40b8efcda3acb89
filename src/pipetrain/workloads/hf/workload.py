"""The `hf` workload: a Hugging Face causal LM (Llama family, GPT-2), a small preset or your pretrained folder.

`pipetrain train --workload hf --model DIR` trains the pretrained model of a local folder (config.json,
safetensors weights, tokenizer files; each rank reads only its own tensors) on text tokenized with the
folder's own tokenizer, packed into windows of `--seq-len` tokens (`--pack none`: one document per row,
padded; `--pack documents`: whole documents per window, attention by document, `pipetrain.data.packing`), every
tenth window held out, perplexity reported (see `hf_text`). Without `--data`, the text is the Gutenberg books.
JSON lines, Parquet and `datasets` folders (plain text, prompt/answer or chat rows trained on their answers) are
read, tokenized once and cached by `pipetrain.data` (docs/data.md). `pipetrain train --workload hf --preset
llama-tiny` (or `gpt2-tiny`, `llama-cpu`, `gpt2-cpu`) builds a small model from a `transformers` config instead,
trained on the `lm` workload's data. The targets are the next tokens (padding -100), so the loss is the token cross-entropy of the logits as they
are. Needs the optional extra: `pip install 'pipetrain[hf]'`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipetrain.data.cache import tokenize_cached, tokenizer_digest
from pipetrain.data.formats import rows_format
from pipetrain.data.packing import PackedDocuments, pack_documents, pack_mode
from pipetrain.data.rows import TokenRows, token_rows
from pipetrain.errors import ConfigError
from pipetrain.workloads.lm.corpus import (HOLD_OUT_EVERY, check_text_only, load_gutenberg, load_text, synthetic_corpus,
                                           text_documents)
from pipetrain.workloads.text.gutenberg import GUTENBERG, gutenberg_books
from pipetrain.workloads.hf.causal_lm import SUPPORTED_FAMILIES, HFCausalLM, require_transformers
from pipetrain.moe.router import RouterAuxLoss
from pipetrain.workloads.hf.blocks import carries_router_statistics
from pipetrain.workloads.hf.families import family_of
from pipetrain.workloads.hf.proof import prove
from pipetrain.workloads.hf.text import (TokenWindows, check_tokenizer, check_vocabulary, ends_with_eos,
                                         load_tokenizer, tokenize_documents, window_batches)
from pipetrain.workloads.lm.workload import LanguageModelWorkload
from pipetrain.workloads.registry import Batch, Dataset, DataRequest

__all__ = ["HFPreset", "HF_PRESETS", "HFWorkload", "DEFAULT_SEQ_LEN", "check_model_folder"]

#: tokens per window of a `--model` folder's job without --seq-len
DEFAULT_SEQ_LEN = 128


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
    """Next-token prediction with a transformers causal LM: a preset's config, or a local model `folder`.

    With a folder (`--model DIR`: config.json, safetensors weights, tokenizer files), the text is tokenized
    with the folder's own tokenizer and packed into windows of `seq_len` tokens (`pack=False`: one document
    per row, padded), see `hf_text`; without `--data` the text is the Gutenberg books. A preset's model
    trains on the `lm` workload's data (the word tokeniser), whose default is the Gutenberg text too.
    """

    name = "hf"
    summary = "a Hugging Face causal LM (Llama, GPT-2): a preset's small config, or --model DIR; needs pipetrain[hf]"
    presets = HF_PRESETS
    windows = True
    data_help = ("plain-text file (paragraphs split by blank lines) or folder of .txt files; with --model also JSON "
                 "lines, Parquet or a datasets folder (text, prompt/answer or chat rows)")

    def __init__(self, folder: str | Path | None = None, seq_len: int = DEFAULT_SEQ_LEN, *,
                 pack: str | bool = "windows") -> None:
        self.folder, self.seq_len, self.pack = (None if folder is None else Path(folder)), seq_len, pack_mode(pack)

    def with_model(self, folder: str | Path, *, pack: str | bool = "windows") -> HFWorkload:
        """This workload on the pretrained model of `folder` (`--model DIR`), checked now: one ConfigError for a
        missing folder, a GGUF file, a folder without config.json or tokenizer, an unsupported model family."""
        path = check_model_folder(Path(folder))
        check_tokenizer(path)
        return HFWorkload(path, self.seq_len, pack=pack)

    def check_preset(self, preset: str) -> None:
        if self.folder is None:
            super().check_preset(preset)

    def window(self, preset: str, *, seq_len: int | None, synthetic: bool) -> int:
        if seq_len is not None:
            return seq_len
        return self._folder_window() if self.folder is not None else HF_PRESETS[preset].seq_len

    def _folder_window(self) -> int:
        """`seq_len`, or the folder model's longest sequence when shorter."""
        config = json.loads((Path(self.folder) / "config.json").read_text())
        longest = config.get("max_position_embeddings") or config.get("n_positions") or self.seq_len
        return min(self.seq_len, longest)

    def model(self, preset: str, *, seq_len: int | None = None) -> HFCausalLM:
        documents = self.pack == "documents"  # the input is (ids, positions): attention by document
        if self.folder is not None:
            return HFCausalLM.from_folder(self.folder, seq_len=seq_len or self._folder_window(), documents=documents)
        self.check_preset(preset)
        spec = HF_PRESETS[preset]
        return HFCausalLM(spec.config(), seq_len=seq_len or spec.seq_len, documents=documents)

    def loss(self) -> Any:
        """The token loss; for a mixture of experts with the load-balancing loss on (`output_router_logits`, a
        non-zero `router_aux_loss_coef`), plus it, per micro-batch (`pipetrain.moe.router.RouterAuxLoss`)."""
        base = super().loss()
        if self.folder is None:
            return base
        config = require_transformers().AutoConfig.from_pretrained(self.folder, local_files_only=True)
        if not carries_router_statistics(config, family_of(config)):
            return base
        return RouterAuxLoss(base, config.router_aux_loss_coef)

    def load_data(self, request: DataRequest) -> tuple[Dataset, Dataset]:
        train, test = self._splits(request)
        if self.pack != "documents":
            return train, test
        if not isinstance(train, (TokenWindows, TokenRows)):
            raise ConfigError("--pack documents packs the documents of a model folder's own text or rows, not the "
                              f"{'synthetic corpus' if request.synthetic else 'word-tokenised text'}",
                              hint="pass --model DIR with --data FILE|DIR (or no --data: the Gutenberg books)")
        seq_len = self.model(request.preset, seq_len=request.seq_len).seq_len
        return pack_documents(train, seq_len=seq_len), pack_documents(test, seq_len=seq_len)

    def _splits(self, request: DataRequest) -> tuple[Dataset, Dataset]:
        model = self.model(request.preset, seq_len=request.seq_len)
        vocab, seq_len = model.config.vocab_size, model.seq_len
        if request.synthetic:
            return synthetic_corpus(num_train=request.train_samples, num_test=request.test_samples,
                                    seq_len=seq_len, vocab_size=vocab, seed=request.seed)
        if self.folder is None:  # a preset's model: the lm workload's word tokeniser
            if request.path is not None:
                return load_text(request.path, seq_len=seq_len, vocab_size=vocab, row_format=request.row_format)
            return load_gutenberg(seq_len=seq_len, vocab_size=vocab)
        if request.path is not None:
            fmt = rows_format(Path(request.path))
            if fmt is not None:
                return self._rows(request, fmt, seq_len, vocab)
            check_text_only(request.row_format, request.path)
            documents, source = text_documents(Path(request.path)), f"text at {request.path}"
        else:
            documents, source = [text for _, text in gutenberg_books()], GUTENBERG.partition(" (")[0]
        return tokenize_documents(documents, load_tokenizer(self.folder), seq_len=seq_len, vocab_size=vocab,
                                  pack=self.pack == "windows", source=f"{source}, tokenized by {self.folder.name}")

    def _rows(self, request: DataRequest, fmt: str, seq_len: int, vocab: int) -> tuple[TokenRows, TokenRows]:
        """JSON lines, Parquet or a datasets folder: tokenized once (cached), read from memory-mapped files."""
        tokenizer = load_tokenizer(self.folder)
        check_vocabulary(tokenizer, vocab)
        eos = tokenizer.eos_token_id
        if eos is None:  # before tokenizing: answers end with it, documents are joined with it
            raise ConfigError(f"the tokenizer of {self.folder.name} has no EOS token", hint="set eos_token in its "
                                                                                             "tokenizer_config.json")
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        done = tokenize_cached(Path(request.path), request.row_format, tokenizer, tokenizer_name=self.folder.name,
                               tokenizer_key=tokenizer_digest(self.folder))
        source = (f"{fmt} at {request.path} ({done.kind} rows, {len(done.rows):,}), tokenized by {self.folder.name}"
                  f"{' (cached)' if done.cached else ''}")
        return token_rows(done.rows, kind=done.kind, seq_len=seq_len, pack=self.pack == "windows",
                          truncate=request.row_format.truncate, pad_id=pad, eos_id=eos, source=source,
                          hold_out_every=HOLD_OUT_EVERY, joiner=0 if ends_with_eos(tokenizer) else 1)

    def batches(self, dataset: Any, batch_size: int, *, shuffle: bool, seed: int, epoch: int, replica: int,
                replicas: int, bucket: bool = False, start: int = 0) -> Iterator[Batch]:
        if isinstance(dataset, (TokenWindows, TokenRows, PackedDocuments)):
            return window_batches(dataset, batch_size, shuffle=shuffle, seed=seed, epoch=epoch, replica=replica,
                                  replicas=replicas, start=start)
        return super().batches(dataset, batch_size, shuffle=shuffle, seed=seed, epoch=epoch, replica=replica,
                               replicas=replicas, bucket=bucket, start=start)

    def describe_data(self, dataset: Any) -> str:
        if isinstance(dataset, PackedDocuments):
            what = "answers of rows" if dataset.supervised else "text"
            return f"{what} packed by document, {self.folder.name if self.folder else ''} tokenizer"
        if isinstance(dataset, TokenRows) and dataset.supervised:
            return f"answers of {self.folder.name if self.folder else ''}-tokenized rows"
        if isinstance(dataset, (TokenWindows, TokenRows)):
            return f"{'packed' if dataset.packed else 'padded'} text, {self.folder.name if self.folder else ''} tokenizer"
        return super().describe_data(dataset)


def check_model_folder(folder: Path) -> Path:
    """`folder` when it holds a Hugging Face model pipetrain can train (its blocks proven against transformers' class
    on a tiny copy of its config, once per job: `proof.prove`); else one ConfigError saying what to do."""
    convert = (f"convert it once to a safetensors folder: python -m pipetrain.workloads.hf.smollm2 convert "
               f"{str(folder)!r} OUT_DIR (or in Python: transformers' from_pretrained(dir, gguf_file=...), the "
               "weights copied into a model built from its config, then save_pretrained(OUT_DIR)), and pass --model OUT_DIR")
    if folder.is_file() and folder.suffix.lower() == ".gguf":
        raise ConfigError(f"--model {str(folder)!r} is a GGUF file (llama.cpp's format): pipetrain reads safetensors",
                          hint=convert)
    if not folder.is_dir():
        raise ConfigError(f"--model {str(folder)!r} is not a folder",
                          hint="pass a folder holding config.json, model.safetensors and the tokenizer files")
    if not (folder / "config.json").is_file():
        ggufs = sorted(folder.glob("*.gguf"))
        if ggufs:
            raise ConfigError(f"model folder {str(folder)!r} holds a GGUF file ({ggufs[0].name}) but no config.json",
                              hint=convert.replace(repr(str(folder)), repr(str(ggufs[0]))))
        raise ConfigError(f"model folder {str(folder)!r} has no config.json",
                          hint="pass a folder written by save_pretrained (config.json, model.safetensors, tokenizer)")
    model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    supported = (f"supported model types: {', '.join(SUPPORTED_FAMILIES)} (Llama-family models such as SmolLM2 "
                 f"and TinyLlama are 'llama'), and others with the common layout; or write a BlockModel of your own")
    try:
        config = require_transformers().AutoConfig.from_pretrained(folder, local_files_only=True)
    except (ValueError, KeyError, OSError) as err:
        if model_type in SUPPORTED_FAMILIES:
            raise ConfigError(f"model folder {str(folder)!r}: transformers cannot read its config.json "
                              f"({type(err).__name__}: {err})".replace("\n", " "),
                              hint="pass a folder written by save_pretrained") from None
        raise ConfigError(f"model folder {str(folder)!r} holds a {model_type!r} model, which pipetrain cannot "
                          "split (transformers does not know this model type)", hint=supported) from None
    try:
        family_of(config)
    except ConfigError as err:
        raise ConfigError(f"model folder {str(folder)!r} holds a {model_type!r} model, which pipetrain cannot "
                          f"split: {err.message.partition(': ')[2] or err.message}",
                          hint=err.hint) from None
    prove(config)
    return folder

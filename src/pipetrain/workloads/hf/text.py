"""Text for a pretrained Hugging Face model: its own tokenizer, documents packed into windows (or one per row).

Packing (the pretraining convention, the default): every document is tokenized with the model folder's
tokenizer (`AutoTokenizer`, as `tokenizer(text)` gives it: its BOS where it adds one), followed by the EOS token, and the documents are joined
into one stream, cut into windows of `seq_len + 1` tokens that overlap by one (so every token is predicted
once): no padding. Every tenth window (the 10th, 20th, ...) is held out. Without packing (`--pack none`), each
document is one row: its first `seq_len + 1` tokens, right-padded with the pad token (EOS where the
tokenizer has none), padding ignored by the loss; every tenth document is held out. The documents are those
of `--data` (one per .txt file of a folder, one per paragraph of a file) or the Gutenberg books. `--pack documents`
packs the rows of `--pack none` whole into windows (`pipetrain.data.packing`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipetrain.data.packing import PackedDocuments
from pipetrain.data.render import text_ids
from pipetrain.data.rows import TokenRows
from pipetrain.errors import ConfigError, DataError
from pipetrain.pipeline.loss import IGNORE_INDEX
from pipetrain.workloads.text.batching import batch_order
from pipetrain.workloads.lm.corpus import HOLD_OUT_EVERY
from pipetrain.workloads.position import replica_shares

__all__ = ["TOKENIZER_FILES", "TokenWindows", "check_tokenizer", "check_vocabulary", "ends_with_eos", "load_tokenizer",
           "tokenize_documents", "window_batches"]

#: files of which a folder needs one for `AutoTokenizer` to load a tokenizer from it
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


@dataclass(frozen=True)
class TokenWindows:
    """Rows of token ids `[N, seq_len + 1]` (padding after `lengths[i]`), as one split of a text."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    pad_id: int
    packed: bool
    source: str
    synthetic: bool = False

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def take(self, part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows `part` `[n, seq_len + 1]`, and None: every token within a row's length trains (as `TokenRows.take`)."""
        return self.tokens[part], None

    @property
    def num_tokens(self) -> int:
        """Tokens predicted in this split (each row's length minus one)."""
        return int((self.lengths - 1).clamp(min=0).sum())


def check_tokenizer(folder: Path) -> None:
    """One ConfigError when a model folder has no tokenizer files (cheap: nothing is loaded)."""
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"model folder {str(folder)!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})",
                          hint="save the model's tokenizer into it: AutoTokenizer.from_pretrained(...)"
                               f".save_pretrained({str(folder)!r})")


def load_tokenizer(folder: Path) -> Any:
    """The tokenizer of a model folder; one ConfigError when the folder has none."""
    from pipetrain.workloads.hf.causal_lm import require_transformers

    check_tokenizer(folder)
    try:
        return require_transformers().AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(f"cannot load the tokenizer of {str(folder)!r}: {err}",
                          hint="save a complete tokenizer with tokenizer.save_pretrained(DIR)") from None


def check_vocabulary(tokenizer: Any, vocab_size: int) -> None:
    """One ConfigError when the tokenizer has more tokens than the model's vocabulary."""
    if len(tokenizer) > vocab_size:
        raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens, the model's vocabulary {vocab_size}",
                          hint="pass the model folder whose tokenizer this is")


def ends_with_eos(tokenizer: Any) -> bool:
    """Whether `tokenizer(text)` ends every text with the EOS token itself (then packing adds none)."""
    ids = tokenizer("a")["input_ids"]
    return bool(ids) and tokenizer.eos_token_id is not None and ids[-1] == tokenizer.eos_token_id


def _ids(tokenizer: Any, documents: list[str]) -> list[list[int]]:
    """Each document's ids as `tokenizer(text)` gives them (its BOS, as the model was trained and generates)."""
    return text_ids(tokenizer, documents)



def tokenize_documents(documents: list[str], tokenizer: Any, *, seq_len: int, vocab_size: int, pack: bool,
                       source: str) -> tuple[TokenWindows, TokenWindows]:
    """Train and held-out splits of `documents` with `tokenizer` (see the module docstring)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ConfigError(f"the tokenizer of {source} has no EOS token to join documents with",
                          hint="set eos_token in its tokenizer_config.json")
    check_vocabulary(tokenizer, vocab_size)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    width = seq_len + 1
    if pack:
        joiner = [] if ends_with_eos(tokenizer) else [eos]  # one EOS between documents, the tokenizer's or ours
        stream = torch.tensor([t for ids in _ids(tokenizer, documents) for t in (*ids, *joiner)], dtype=torch.long)
        count = (len(stream) - 1) // seq_len
        rows = [stream[i * seq_len : i * seq_len + width] for i in range(count)]
        how = f"packed into windows of {seq_len} tokens"
    else:
        rows = [torch.tensor(ids[:width], dtype=torch.long) for ids in _ids(tokenizer, documents) if len(ids) >= 2]
        how = f"one document per row, cut to {seq_len} tokens"
    unit = "window" if pack else "document"
    test, train = rows[HOLD_OUT_EVERY - 1 :: HOLD_OUT_EVERY], [r for i, r in enumerate(rows) if i % HOLD_OUT_EVERY != HOLD_OUT_EVERY - 1]
    if not train or not test:
        raise DataError(f"{source} gives {len(rows)} {unit}(s) of {seq_len} tokens; a train and a held-out split "
                        f"need {HOLD_OUT_EVERY}", hint="give more text, or a shorter --seq-len")

    def split(part: list[torch.Tensor], name: str) -> TokenWindows:
        tokens = torch.full((len(part), width), pad, dtype=torch.long)
        for i, row in enumerate(part):
            tokens[i, : len(row)] = row
        lengths = torch.tensor([len(row) for row in part], dtype=torch.long)
        return TokenWindows(tokens, lengths, pad, pack, f"{source}, {how}, {name} split ({len(part)} {unit}s)")

    return split(train, "train"), split(test, "held-out")


def window_batches(data: TokenWindows | TokenRows | PackedDocuments, batch_size: int, *, shuffle: bool, seed: int,
                   epoch: int, replica: int = 0, replicas: int = 1,
                   start: int = 0) -> Iterator[tuple[Any, torch.Tensor]]:
    """One epoch of `(input ids, next-token targets)` `[share, seq_len]` for replica `replica` of `replicas`:
    global batches of `batch_size` rows cut into equal contiguous shares (as `corpus.token_batches`), from global
    sample `start` of the epoch's order on; targets past a row's end, and of tokens that do not train (a prompt, a
    user turn), are `IGNORE_INDEX` (by position: a pad id may be a real token). `data`: rows in memory
    (`TokenWindows`) or read per batch from memory-mapped files (`pipetrain.data.rows.TokenRows`); documents packed
    by `pipetrain.data.packing` give `((input ids, positions), targets)`."""
    order = batch_order(data.lengths, batch_size, shuffle=shuffle, bucket=False, seed=seed,
                        stream=f"hf-epoch-{epoch}", bucket_stream=f"hf-buckets-{epoch}")
    for _, part in replica_shares(order, batch_size, replica=replica, replicas=replicas, start=start):
        if isinstance(data, PackedDocuments):  # the positions travel with the ids: the model masks by document
            ids, positions, targets = data.take(part)
            yield (ids, positions), targets
            continue
        tokens, trained = data.take(part)
        targets = tokens[:, 1:].clone()
        targets[torch.arange(1, tokens.shape[1])[None, :] >= data.lengths[part][:, None]] = IGNORE_INDEX
        if trained is not None:
            targets[~trained[:, 1:]] = IGNORE_INDEX
        yield tokens[:, :-1], targets

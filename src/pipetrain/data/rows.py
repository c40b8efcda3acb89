"""Tokenized rows as training samples of `width` tokens (`seq_len + 1`), read from the memory-mapped rows a batch
at a time (`TokenRows.take`): only the lengths of the rows are held in memory.

- plain text, packed (`--pack`, the pretraining convention): the documents joined with EOS into one stream, cut
  into windows of `width` tokens that overlap by one; every token trains.
- plain text, one document per row (`--pack none`): its first `width` tokens; every token trains.
- instruction and chat rows: one example per row, its `trained` tokens (the answers) train, all others are
  ignored. A row longer than `width` is dropped (`--truncate drop`), or its prompt is cut from the left
  (`--truncate left`) when that leaves every trained token and one token before them; else it is dropped.

Every `hold_out_every`-th row of the data (by its index in the data, before rows are filtered by length, cut or
packed) is held out: the held-out split holds those rows' samples alone (packed: their own stream of windows), so
no window, truncation, packing or layout ever trains on a held-out row.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from pipetrain.errors import DataError

__all__ = ["TokenRows", "held_out", "token_rows"]


@dataclass(frozen=True)
class TokenRows:
    """One split of tokenized rows: sample `i` is row `index[i]` from token `offsets[i]` on, `lengths[i]` tokens
    (packed: window `index[i]` of the stream of documents that start at `starts`)."""

    rows: Any
    index: torch.Tensor
    lengths: torch.Tensor
    offsets: torch.Tensor
    width: int
    pad_id: int
    eos_id: int
    packed: bool
    supervised: bool
    source: str
    starts: torch.Tensor | None = None
    synthetic: bool = False
    #: packed: the rows whose stream this is, in order (document `d` of `starts` is row `docs[d]`)
    docs: torch.Tensor | None = None
    #: packed: the EOS tokens put after each document (0: its tokens end with the tokenizer's own EOS already)
    joiner: int = 1

    def __len__(self) -> int:
        return len(self.index)

    @property
    def num_tokens(self) -> int:
        """Tokens predicted in this split (each sample's length minus one; with answers only, fewer train)."""
        return int((self.lengths - 1).clamp(min=0).sum())

    @cached_property
    def arrow(self) -> Any:
        """The rows read as Arrow tables (made once: `with_format` copies the dataset's description each call)."""
        return self.rows.with_format("arrow")

    def take(self, part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Samples `part` as token ids `[n, width]` (padded with `pad_id` after their lengths) and, for instruction
        and chat rows, which tokens train `[n, width]` (bool; None: every token within the length does). One read
        of the mapped Arrow rows a batch, gathered as tensors (no Python loop over rows or tokens)."""
        if self.packed:
            return self._windows(self.index[part]), None
        rows = self.index[part]
        at = torch.arange(self.width)[None, :]
        inside = at < self.lengths[part][:, None]
        where = (self.offsets[part][:, None] + at)[inside]  # the token of each kept position within its row
        table = self.arrow[rows.tolist()]
        ids, row_starts = _flat(table, "input_ids")
        local = torch.arange(len(rows))[:, None].expand(-1, self.width)[inside]
        tokens = torch.full((len(part), self.width), self.pad_id, dtype=torch.long)
        tokens[inside] = ids[row_starts[local] + where]
        trained = None
        if self.supervised:
            flags, _ = _flat(table, "trained")
            trained = torch.zeros((len(part), self.width), dtype=torch.bool)
            trained[inside] = flags[row_starts[local] + where].bool()
        return tokens, trained

    def _windows(self, windows: torch.Tensor) -> torch.Tensor:
        """Windows `windows` of the stream of documents joined by EOS: position `p` of the stream is token
        `p - starts[d]` of document `d` (the last `starts[d] <= p`), or its EOS where that is its length."""
        at = windows[:, None] * (self.width - 1) + torch.arange(self.width)[None, :]
        doc = torch.searchsorted(self.starts, at, right=True) - 1
        offset = at - self.starts[doc]
        docs, local = torch.unique(doc, return_inverse=True)
        rows = docs if self.docs is None else self.docs[docs]
        ids, doc_starts = _flat(self.arrow[rows.tolist()], "input_ids")
        ends = offset >= (self.starts[doc + 1] - self.starts[doc] - self.joiner)  # the EOS after the document
        picked = (doc_starts[local] + offset).clamp(max=max(len(ids) - 1, 0))
        return torch.where(ends, torch.tensor(self.eos_id), ids[picked] if len(ids) else torch.tensor(self.eos_id))


def _flat(table: Any, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The lists of column `name` of the Arrow `table` (a batch's rows, read at once), concatenated (int64), and
    where each row's list starts in them."""
    column = table[name].combine_chunks()
    values = torch.from_numpy(column.flatten().to_numpy(zero_copy_only=False).astype("int64", copy=False))
    counts = torch.from_numpy(column.value_lengths().to_numpy(zero_copy_only=False).astype("int64", copy=False))
    return values, torch.cumsum(counts, 0) - counts


def _column(rows: Any, name: str) -> torch.Tensor:
    return torch.as_tensor(rows.with_format("numpy")[name], dtype=torch.long)


def held_out(count: int, every: int) -> torch.Tensor:
    """Whether each of `count` source rows is held out: every `every`-th (the 10th, 20th, ...) by its index in the
    data, before any filtering, packing or truncation, so the same rows are held out under any window, truncation,
    packing and layout."""
    return torch.arange(count) % every == every - 1


def token_rows(rows: Any, *, kind: str, seq_len: int, pack: bool, truncate: str, pad_id: int, eos_id: int,
               source: str, hold_out_every: int = 10, joiner: int = 1) -> tuple[TokenRows, TokenRows]:
    """Train and held-out splits of the tokenized `rows` of `kind` (see the module docstring); `source` names the
    data in the start-up line, followed by how the rows became samples and how many the truncation touched.
    `joiner`: the EOS tokens packing puts after each document (0 where the tokenizer ends every text with EOS)."""
    width = seq_len + 1
    lengths = _column(rows, "length")
    supervised = kind != "text"
    held = held_out(len(lengths), hold_out_every)
    if kind == "text" and pack:
        how, unit = f"packed into windows of {seq_len} tokens", "window"
        splits = [_stream(torch.nonzero(~held).flatten(), lengths, seq_len, joiner),
                  _stream(torch.nonzero(held).flatten(), lengths, seq_len, joiner)]
    elif kind == "text":
        keep = lengths >= 2
        how, unit = f"one document per row, cut to {seq_len} tokens", "document"
        splits = [_rows(torch.nonzero(keep & part).flatten(), lengths.clamp(max=width), None)
                  for part in (~held, held)]
    else:
        first = _column(rows, "first")
        cut = (lengths - width).clamp(min=0)
        fits = cut == 0
        cuttable = (cut > 0) & (cut <= first - 1) if truncate == "left" else torch.zeros_like(fits)
        keep = fits | cuttable
        dropped, touched = int((~keep).sum()), int(cuttable.sum())
        if not keep.any():
            raise DataError(f"{source}: no example is left: all {len(rows)} rows are longer than --seq-len {seq_len} "
                            f"(+1) tokens{' and their answers too' if truncate == 'left' else ''}",
                            hint="pass a longer --seq-len" + ("" if truncate == "left" else
                                                               ", or --truncate left to cut prompts from the left"))
        cut_text = f", {touched} cut from the left" if truncate == "left" else ""
        apart = int(_column(rows, "apart").sum()) if "apart" in rows.column_names else 0
        apart_text = (f"; {apart} row(s) whose prompt and answer the tokenizer merges across the joint tokenized "
                      "apart" if apart else "")
        how = (f"one example per row, {'assistant turns' if kind == 'chat' else 'answers'} trained; rows longer "
               f"than {width} tokens: {dropped} dropped{cut_text} (--truncate {truncate}){apart_text}")
        unit = "example"
        splits = [_rows(torch.nonzero(keep & part).flatten(), lengths - cut, cut) for part in (~held, held)]
    (train, *_), (test, *_) = splits
    if not len(train) or not len(test):
        raise DataError(f"{source} gives {len(train) + len(test)} {unit}(s) of {seq_len} tokens, {len(test)} of them "
                        f"from the held-out rows (every {hold_out_every}th row of the data); a train and a held-out "
                        "split need both", hint="give more data, or a shorter --seq-len")

    def split(part: tuple, name: str) -> TokenRows:
        index, kept, offsets, starts, docs = part
        return TokenRows(rows, index, kept, offsets, width, pad_id, eos_id, kind == "text" and pack, supervised,
                         f"{source}, {how}, {name} split ({len(index):,} {unit}s; held out: every {hold_out_every}th "
                         "row of the data)", starts, docs=docs, joiner=joiner)

    return split(splits[0], "train"), split(splits[1], "held-out")


def _rows(index: torch.Tensor, kept: torch.Tensor, cut: torch.Tensor | None) -> tuple:
    """One example per row: the rows `index`, their kept lengths and the tokens cut from their left."""
    offsets = torch.zeros(len(index), dtype=torch.long) if cut is None else cut[index]
    return index, kept[index], offsets, None, None


def _stream(docs: torch.Tensor, lengths: torch.Tensor, seq_len: int, joiner: int) -> tuple:
    """The windows of the stream of the rows `docs` joined by EOS (`joiner` of them): window indices, lengths,
    offsets, where each document starts in the stream, and the documents (rows)."""
    starts = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths[docs] + joiner, 0)])
    count = max(int(starts[-1]) - 1, 0) // seq_len
    return (torch.arange(count), torch.full((count,), seq_len + 1), torch.zeros(count, dtype=torch.long), starts,
            docs)

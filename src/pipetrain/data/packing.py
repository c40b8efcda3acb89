"""Packing by document (`--pack documents`): whole documents (tokenized rows) laid side by side in windows of
`seq_len` tokens, each with its own positions from 0, so that a model that masks attention by document sees each
exactly as if it ran alone.

A document of `L` tokens takes `L - 1` slots of a window: its tokens 0 .. L-2 are inputs, at positions 0 .. L-2,
and predict its tokens 1 .. L-1 (its last token is never an input: its prediction would have no target). Its
first slot has no document before it: a token is trained only on the tokens of its own document. The documents
are the samples of one split as `--pack none` makes them (a row of plain text cut to `seq_len + 1` tokens; an
instruction or chat row after the truncation policy, its non-answer tokens ignored by the loss), placed by best
fit decreasing (longest first, each into the window with the least room that holds it; ties by index, so the
windows are a function of the lengths alone). The slots a window leaves free are padding: their own run of
positions from 0, every target ignored.

The per-token positions travel with the token ids as a second input (`PackedDocuments.take`): the model derives
the block-diagonal causal mask from them inside each decoder layer, per micro-batch, after the schedule has split
the batch (`pipetrain.workloads.hf.blocks`). Packing efficiency: the trained tokens over the window tokens (for
instruction and chat rows, the document tokens: only their answers train).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass
from typing import Any

import torch

from pipetrain.data.fields import PACK_MODES, pack_mode

__all__ = ["PACK_MODES", "PackedDocuments", "pack_documents", "pack_lengths", "pack_mode"]

#: the target of a token that does not train (`pipetrain.pipeline.loss.IGNORE_INDEX`, which data does not import)
IGNORE = -100


def pack_lengths(sizes: list[int], capacity: int) -> list[list[int]]:
    """Bins of item indices whose sizes sum to at most `capacity` each, by best fit decreasing (each item, longest
    first, into the bin with the least room left that holds it, else a new bin); items in index order in a bin."""
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    bins: list[list[int]] = []
    rooms: list[int] = []  # the distinct rooms left that some bin has, sorted
    with_room: dict[int, list[int]] = {}  # room left -> the bins with it (lowest index last)
    for item in order:
        size = sizes[item]
        if not 0 < size <= capacity:
            raise ValueError(f"item {item} of size {size} does not fit a bin of {capacity}")
        at = bisect_left(rooms, size)
        if at == len(rooms):
            chosen, room = len(bins), capacity
            bins.append([])
        else:
            room = rooms[at]
            chosen = with_room[room].pop()
            if not with_room[room]:
                del with_room[room], rooms[at]
        bins[chosen].append(item)
        left = room - size
        if left:
            if left not in with_room:
                insort(rooms, left)
                with_room[left] = []
            with_room[left].insert(0, chosen)
    return [sorted(members) for members in bins]


@dataclass(frozen=True)
class PackedDocuments:
    """Windows of whole documents: window `w` holds documents `members[bounds[w]:bounds[w + 1]]` of `documents` (a
    split with `take(part) -> (tokens [n, seq_len + 1], trained [n, seq_len + 1] or None)` and `lengths`)."""

    documents: Any
    members: torch.Tensor
    bounds: torch.Tensor
    lengths: torch.Tensor  #: slots each window fills
    seq_len: int
    pad_id: int
    source: str
    packed: bool = True
    synthetic: bool = False

    def __len__(self) -> int:
        return len(self.bounds) - 1

    @property
    def supervised(self) -> bool:
        return bool(getattr(self.documents, "supervised", False))

    @property
    def num_tokens(self) -> int:
        """Document tokens that predict the next one in this split (all train, but for instruction and chat rows:
        only their answers)."""
        return int(self.lengths.sum())

    @property
    def efficiency(self) -> float:
        """`num_tokens` over the window tokens: the trained share of the windows (of plain text)."""
        return self.num_tokens / max(len(self) * self.seq_len, 1)

    def take(self, part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Windows `part` as `(token ids, positions, targets)`, each `[n, seq_len]` (see the module docstring)."""
        n = len(part)
        ids = torch.full((n, self.seq_len), self.pad_id, dtype=torch.long)
        positions = torch.zeros((n, self.seq_len), dtype=torch.long)
        targets = torch.full((n, self.seq_len), IGNORE, dtype=torch.long)
        spans = [(int(self.bounds[w]), int(self.bounds[w + 1])) for w in part.tolist()]
        docs = torch.cat([self.members[a:b] for a, b in spans]) if spans else self.members[:0]
        tokens, trained = self.documents.take(docs)
        lengths = self.documents.lengths[docs].tolist()
        row = 0
        for j, (a, b) in enumerate(spans):
            at = 0
            for _ in range(b - a):
                used = lengths[row] - 1
                ids[j, at : at + used] = tokens[row, :used]
                positions[j, at : at + used] = torch.arange(used)
                target = tokens[row, 1 : used + 1]
                if trained is not None:
                    target = torch.where(trained[row, 1 : used + 1], target, IGNORE)
                targets[j, at : at + used] = target
                at, row = at + used, row + 1
            positions[j, at:] = torch.arange(self.seq_len - at)  # padding: a run of its own
        return ids, positions, targets


def pack_documents(documents: Any, *, seq_len: int) -> PackedDocuments:
    """The documents of one split (see the module docstring) packed into windows of `seq_len` tokens."""
    lengths = documents.lengths
    kept = torch.nonzero(lengths >= 2).flatten()  # a single token predicts nothing
    sizes = (lengths[kept] - 1).clamp(max=seq_len).tolist()
    bins = pack_lengths(sizes, seq_len)
    members = torch.tensor([int(kept[i]) for members in bins for i in members], dtype=torch.long)
    counts = torch.tensor([len(members) for members in bins], dtype=torch.long)
    bounds = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(counts, 0)])
    filled = torch.tensor([sum(sizes[i] for i in members) for members in bins], dtype=torch.long)
    packed = PackedDocuments(documents, members, bounds, filled, seq_len, documents.pad_id, "")
    what = ("document tokens / window tokens, of which the answers train" if packed.supervised
            else "trained tokens / window tokens")
    source = (f"{documents.source}; packed by document into {len(bins):,} windows of {seq_len} tokens (packing "
              f"efficiency {packed.efficiency:.1%}: {what}; attention and positions per document)")
    return PackedDocuments(documents, members, bounds, filled, seq_len, documents.pad_id, source,
                           synthetic=bool(getattr(documents, "synthetic", False)))

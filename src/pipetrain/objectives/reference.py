"""The reference model's answer log-probabilities, computed once by a forward-only pass through the same pipeline.

DPO compares the policy with the model it started from. pipetrain holds no second copy of the model: before the
first step (and before a checkpoint's weights are loaded, so a resumed job gets the same numbers) each pair's
chosen and rejected answers go through the engine's evaluation path, and the last stage sums their log-probs
(`logps.sequence_logps`). With LoRA the adapters are switched off for that pass: the reference is the frozen base.
Each replica computes its own share; the table is summed over every rank (each pair written by one rank) so every
rank holds it all. With a save folder the table is stored there (`reference-logps.pt`, keyed by a digest of the
pairs' tokens), and a resumed job reads it instead of recomputing it.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch
import torch.distributed as dist

from pipetrain.lora import adapters_disabled
from pipetrain.objectives.columns import split_columns
from pipetrain.objectives.logps import sequence_logps
from pipetrain.objectives.pairs import PreferencePairs
from pipetrain.pipeline import PipelineEngine

__all__ = ["REFERENCE_FILE", "pairs_digest", "reference_logps", "attach_reference"]

log = logging.getLogger("pipetrain")

#: the file of a save folder that holds the reference table
REFERENCE_FILE = "reference-logps.pt"


def pairs_digest(pairs: PreferencePairs) -> str:
    """A digest of the pairs' tokens and answer masks: a stored table belongs to these pairs alone."""
    digest = hashlib.blake2b(digest_size=16)
    for tensor in (pairs.tokens, pairs.trained):
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()


def reference_logps(engine: PipelineEngine, pairs: PreferencePairs, *, batch_size: int, dp_rank: int, dp: int,
                    group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Each pair's (chosen, rejected) answer log-probability `[N, 2]` (float64) under the engine's weights as they
    are (adapters off), on every rank. Collective: every rank of the job (`group`, default the whole world) calls it
    with the same pairs."""
    table = torch.zeros(len(pairs) * 2, dtype=torch.float64)
    chunks = [torch.arange(s, min(s + batch_size, len(pairs))) for s in range(0, len(pairs), batch_size)]
    rounds = -(-len(chunks) // dp)
    kept = engine.keep_outputs
    engine.keep_outputs = True
    try:
        with adapters_disabled(engine.modules):
            for round_ in range(rounds):  # every rank runs as many passes (the engine's metrics are collective)
                index = round_ * dp + dp_rank
                part = chunks[min(index, len(chunks) - 1)]
                x, targets = pairs.take(part)
                result = engine.evaluate(x, None)
                if index < len(chunks) and result.outputs is not None and engine.counts_metrics:
                    labels, _ = split_columns(targets, 1)
                    logps, _ = sequence_logps(result.outputs, labels.to(result.outputs.device))
                    rows = torch.stack([2 * part, 2 * part + 1], dim=1).flatten()
                    table[rows] = logps.detach().double().cpu()
    finally:
        engine.keep_outputs = kept
    if dist.is_initialized():
        summed = table.to(engine.device)
        dist.all_reduce(summed, group=group)
        table = summed.cpu()
    return table.view(-1, 2)


def attach_reference(engine: PipelineEngine, splits: dict[str, PreferencePairs], *, batch_size: int, dp_rank: int,
                     dp: int, store: Path | None, main: bool, group: dist.ProcessGroup | None = None) -> bool:
    """Fill each split's `reference` from `store`'s file when it holds these pairs, else by `reference_logps`
    (written to `store` by the `main` rank). Returns whether they were computed (False: read)."""
    path = None if store is None else Path(store) / REFERENCE_FILE
    digests = {name: pairs_digest(pairs) for name, pairs in splits.items()}
    if path is not None and path.is_file():
        saved = torch.load(path, weights_only=True)
        if all(saved.get(f"{name}/digest") == digest for name, digest in digests.items()):
            for name, pairs in splits.items():
                pairs.reference = saved[f"{name}/logps"]
            return False
    for name, pairs in splits.items():
        pairs.reference = reference_logps(engine, pairs, batch_size=batch_size, dp_rank=dp_rank, dp=dp, group=group)
    if path is not None and main:
        path.parent.mkdir(parents=True, exist_ok=True)
        table = {f"{name}/logps": pairs.reference for name, pairs in splits.items()}
        table.update({f"{name}/digest": digest for name, digest in digests.items()})
        torch.save(table, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").replace(path)
    return True

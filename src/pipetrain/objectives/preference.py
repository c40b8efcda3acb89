"""`--objective dpo`: a Hugging Face model folder trained on preference pairs, as a workload the trainer runs.

`PreferenceWorkload` wraps the `hf` workload of a model folder: the same model and window, its data read as TRL's
preference rows (`pairs.read_pairs`), batches of pairs with each pair's two rows adjacent (so a micro-batch of an
even number of rows never splits one), the loss one of TRL's (`dpo_loss.PreferenceLoss`), and, before training,
the reference log-probabilities (`reference.attach_reference`; none for a reference-free loss). `--batch-size`
counts pairs: the pipeline sees twice as many rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipetrain.errors import ConfigError
from pipetrain.objectives.folder import FolderObjective
from pipetrain.objectives.dpo_loss import DPOSettings, PreferenceLoss
from pipetrain.objectives.pairs import PreferencePairs, pair_batches, pair_count, read_pairs
from pipetrain.objectives.reference import attach_reference
from pipetrain.pipeline import PipelineEngine
from pipetrain.workloads.hf.text import load_tokenizer
from pipetrain.workloads.registry import Batch, Dataset, DataRequest

__all__ = ["PreferenceWorkload", "check_pair_batches"]


def check_pair_batches(batch_size: int, dp: int, chunks: int) -> None:
    """One ConfigError unless each replica's pairs split evenly into `chunks` micro-batches (a pair in one)."""
    per_replica = batch_size // max(dp, 1)
    if per_replica % chunks:
        raise ConfigError(f"--batch-size {batch_size} gives {per_replica} pair(s) per replica, which --chunks "
                          f"{chunks} does not divide: a preference pair must stay in one micro-batch",
                          hint=f"pass --batch-size {dp * chunks * max(1, per_replica // chunks)} (pairs), or "
                               f"fewer --chunks")


class PreferenceWorkload(FolderObjective):
    """The `hf` workload of a model folder trained on preference pairs with a DPO-family loss (`settings`)."""

    metrics = ("accuracy",)
    windows = True
    rows_per_sample = 2  # each pair's chosen and rejected rows, interleaved (`PreferencePairs.take`)
    needs_folder = ("--objective dpo trains a pretrained model folder on preference rows",
                    "pass --workload hf --model DIR --data pairs.jsonl")
    settings: DPOSettings

    def load_data(self, request: DataRequest) -> tuple[PreferencePairs, PreferencePairs]:
        if request.synthetic or request.path is None:
            raise ConfigError("--objective dpo trains on preference rows: no --data was given",
                              hint="pass --data pairs.jsonl (rows of prompt, chosen, rejected)")
        tokenizer = load_tokenizer(self.inner.folder)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        seq_len = request.seq_len or self.inner.window(request.preset, seq_len=None, synthetic=False)
        return read_pairs(Path(request.path), tokenizer, seq_len=seq_len, pad_id=pad or 0)

    def batches(self, dataset: Any, batch_size: int, *, shuffle: bool, seed: int, epoch: int, replica: int,
                replicas: int, bucket: bool = False, start: int = 0) -> Iterator[Batch]:
        # training drops a last short batch (its pairs could not fill the micro-batches); evaluation reads all
        return pair_batches(dataset, batch_size, shuffle=shuffle, seed=seed, epoch=epoch, replica=replica,
                            replicas=replicas, start=start, drop_last=shuffle)

    def num_batches(self, dataset: Any, batch_size: int, *, replicas: int) -> int:
        return pair_count(dataset, batch_size, replicas=replicas)

    def loss(self) -> PreferenceLoss:
        return PreferenceLoss(self.settings)

    def before_training(self, engine: PipelineEngine, splits: dict[str, Dataset], *, mesh: Any, batch_size: int,
                        store: Path | None, main: bool) -> None:
        """The reference log-probabilities of `splits` (name -> pairs), by the engine's weights as they are now
        (the initial ones: call it before a checkpoint is loaded) or from `store`; nothing for a reference-free
        loss. Collective: every rank calls it."""
        if not self.settings.reference_free:
            attach_reference(engine, dict(splits), batch_size=batch_size, dp_rank=mesh.dp_rank, dp=mesh.dp,
                             store=store, main=main)

    def describe_data(self, dataset: Any) -> str:
        return f"preference pairs, {self.inner.folder.name} tokenizer, {self.settings.loss} loss"

    def eval_split(self, dataset: Any) -> str:
        return "held-out"

"""One rank of `pipetrain eval`: the held-out split through the training pipeline's evaluation path (the same
engine, batches and loss as the evaluations during training: `engine.evaluate`, `MetricTotals`), then, for
instruction and chat rows, each held-out prompt's answer generated greedily through the same stages
(`EngineGenerator`) and compared with the reference answer by exact match (`answers.py`). Rank 0 prints the figures
and writes them as JSON."""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.checkpoint.state import load_checkpoint
from pipetrain.data.packing import PackedDocuments
from pipetrain.data.rows import TokenRows
from pipetrain.evaluate.answers import AnswerScore, cut_at, split_row
from pipetrain.generate.engine import EngineGenerator
from pipetrain.generate.job import eos_ids
from pipetrain.generate.prompts import left_pad
from pipetrain.generate.sampling import Sampling
from pipetrain.launch.ranks import RankSpec
from pipetrain.logs.records import MetricTotals, perplexity
from pipetrain.session import Session, close_session, open_session
from pipetrain.train.config import TrainConfig, load_data
from pipetrain.train.loop import evaluate_split
from pipetrain.workloads.hf.text import load_tokenizer
from pipetrain.workloads.registry import Dataset

__all__ = ["EvalJob", "answer_rows", "eval_rank", "held_out_loss", "held_out_totals"]

log = logging.getLogger("pipetrain")


@dataclass(frozen=True)
class EvalJob:
    """The model and data (`config`: hf workload, model folder, data, window, batch size, layout), the checkpoint
    whose weights to evaluate (None: the folder's own), whether to generate answers, how long they may be, and how
    many held-out rows to answer (None: all), and where to write the figures (JSON; None: nowhere)."""

    config: TrainConfig
    checkpoint: Path | None = None
    answers: bool = True
    max_new_tokens: int = 32
    max_answers: int | None = None
    out: Path | None = None


def held_out_totals(session: Session, config: TrainConfig, test: Dataset) -> MetricTotals:
    """The figures of `test` added up as the training loop evaluates it (every sample of the split once)."""
    return evaluate_split(session.engine, config.task(), test, config, session.mesh.dp_rank)[0]


def held_out_loss(session: Session, config: TrainConfig, test: Dataset) -> tuple[float, float, int]:
    """(loss, token accuracy, tokens) of `test` as the training loop evaluates it (every batch of the split)."""
    totals = held_out_totals(session, config, test)
    loss, accuracy = totals.means()
    return loss, accuracy, int(totals.count)


def _answers(session: Session, job: EvalJob, test: TokenRows) -> AnswerScore:
    """Exact-match score of the greedy answers to this replica's share of the held-out rows (batches `dp_rank`,
    `dp_rank + dp`, ...; every replica takes as many turns, see `_chunk_starts`); summed over the replicas by the
    caller."""
    config = job.config
    model = config.model()
    folder = Path(config.model_dir)
    tokenizer = load_tokenizer(folder)
    stops = set(tokenizer.all_special_ids) | set(eos_ids(folder, model.config, tokenizer))
    generator = EngineGenerator(session.engine, session.mesh, model.config, folder)
    count = len(test) if job.max_answers is None else min(job.max_answers, len(test))
    tokens, trained = test.take(torch.arange(count))
    rows = [split_row(t[:n], f[:n]) for t, f, n in zip(tokens, trained, test.lengths[:count].tolist())]
    rows = [row for row in rows if row is not None]
    score, context = AnswerScore(), model.config.max_position_embeddings
    size, dp, replica = config.batch_size, config.parallel.dp, session.mesh.dp_rank
    for start in _chunk_starts(len(rows), size, dp, replica):
        chunk = rows[start:start + size]
        if not chunk:  # this replica's share is done: an empty turn, so that every replica gathers as often
            if rows:
                generator.generate(left_pad([rows[0][0]], test.pad_id), Sampling(), 1)
            continue
        batch = left_pad([prompt for prompt, _ in chunk], test.pad_id)
        new = max(1, min(job.max_new_tokens, context - batch.ids.shape[1]))
        done = generator.generate(batch, Sampling(), new)
        for (_, reference), row in zip(chunk, done.tokens.tolist()):
            score.add(tokenizer.decode(cut_at(row, stops), skip_special_tokens=True),
                      tokenizer.decode(cut_at(reference, stops), skip_special_tokens=True))
    return score


def _chunk_starts(rows: int, size: int, dp: int, replica: int) -> list[int]:
    """Where this replica's chunks of `size` rows begin (chunks `replica`, `replica + dp`, ...), one turn per round
    of `dp` chunks: every replica gets as many turns, those past the last row empty (start >= `rows`). Each
    generation is a collective call over the replicas too (FSDP gathers the weights for it), so a replica with one
    chunk fewer would leave the others waiting for good."""
    rounds = -(-rows // (size * dp))
    return [(turn * dp + replica) * size for turn in range(rounds)]


def answer_rows(test: Dataset) -> TokenRows | None:
    """The held-out prompt/answer or chat rows of `test` whose answers are generated: the rows themselves, or the
    documents a `--pack documents` split packs; None for plain text."""
    rows = test.documents if isinstance(test, PackedDocuments) else test
    return rows if isinstance(rows, TokenRows) and rows.supervised else None


def _sum_over_replicas(score: AnswerScore, session: Session, device: torch.device) -> tuple[int, int]:
    """(correct, total) over the replicas: the ranks of one replica hold the same figures, so each counts once."""
    first = session.mesh.pp_rank == 0 and session.mesh.tp_rank == 0
    figures = torch.tensor([score.correct, score.total] if first else [0, 0], dtype=torch.long, device=device)
    dist.all_reduce(figures)
    return int(figures[0]), int(figures[1])


def eval_rank(spec: RankSpec, job: EvalJob, data: tuple[Dataset, Dataset] | None = None) -> dict[str, Any]:
    """Evaluate on this rank; every rank returns the same figures (rank 0 prints them and writes `job.out`)."""
    config = job.config
    _, test = data if data is not None else load_data(config)
    session = open_session(spec, config.model(), config.parallel, seed=config.seed, loss_fn=config.task().loss(),
                           precision=config.precision)
    try:
        before = getattr(config.task(), "before_training", None)  # DPO: the reference, by the initial weights
        if before is not None:
            before(session.engine, {"test": test}, mesh=session.mesh, batch_size=config.batch_size, store=None,
                   main=dist.get_rank() == 0)
        if job.checkpoint is not None:
            load_checkpoint(job.checkpoint, session.engine, model_name=None)
        if config.objective is not None:  # DPO's pairs (eval takes no other): the loss, the pairs ranked right, rewards
            totals = held_out_totals(session, config, test)
            loss, accuracy = totals.means()
            figures = {"model": str(job.checkpoint or config.model_dir), "data": test.source, "loss": loss,
                       "preference_accuracy": accuracy, "pairs": int(totals.count), **totals.extra_means()}
            if dist.get_rank() == 0:
                _say_pairs(figures, job)
            return figures
        loss, token_accuracy, tokens = held_out_loss(session, config, test)
        figures: dict[str, Any] = {"model": str(job.checkpoint or config.model_dir), "data": test.source,
                                   "loss": loss, "perplexity": perplexity(loss, ("perplexity",)),
                                   "token_accuracy": token_accuracy, "tokens": tokens}
        rows = answer_rows(test)
        supervised = rows is not None
        if job.answers and supervised:
            score = _answers(session, job, rows)
            correct, total = _sum_over_replicas(score, session, session.device)
            figures.update(answer_accuracy=correct / total if total else None, answers=total, correct=correct,
                           examples=score.examples)
        if dist.get_rank() == 0:
            _say(figures, supervised, job)
        return figures
    finally:
        close_session(after_error=sys.exc_info()[1] is not None)


def _say_pairs(figures: dict[str, Any], job: EvalJob) -> None:
    rewards = ", ".join(f"{k} {v:.4f}" for k, v in figures.items() if k.startswith("rewards/"))
    print(f"held-out preference accuracy {figures['preference_accuracy']:.4f} over {figures['pairs']:,} pairs, loss "
          f"{figures['loss']:.4f} ({rewards}) ({figures['data']})", flush=True)
    if job.out is not None:
        job.out.write_text(json.dumps(figures, indent=2) + "\n")


def _say(figures: dict[str, Any], supervised: bool, job: EvalJob) -> None:
    lines = [f"held-out loss {figures['loss']:.4f}, perplexity {figures['perplexity']:.3f}, token accuracy "
             f"{figures['token_accuracy']:.4f} over {figures['tokens']:,} tokens ({figures['data']})"]
    if "answer_accuracy" in figures:
        for answer, reference, hit in figures["examples"]:
            lines.append(f"  {'=' if hit else 'x'} answer {answer[:60]!r} | reference {reference[:60]!r}")
        accuracy = figures["answer_accuracy"]
        lines.append(f"answer accuracy (exact match after normalisation) {figures['correct']}/{figures['answers']}"
                     f" = {accuracy if accuracy is None else round(accuracy, 4)}")
    elif job.answers and not supervised:
        lines.append("no answer accuracy: the data holds plain text, not prompt/answer or chat rows")
    print("\n".join(lines), flush=True)
    if job.out is not None:
        job.out.write_text(json.dumps(figures, indent=2) + "\n")

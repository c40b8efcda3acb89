"""`--objective grpo`: rollouts generated through the pipeline by the policy as it is, scored, trained on.

`GRPOWorkload` wraps the `hf` workload of a model folder. Its data are prompt rows (`prompt_rows`). Each global
batch of `--batch-size` completions is `batch_size / G` prompts: every replica takes its share, generates `G`
completions of each through the training engine's own stages (`generate.EngineGenerator`: no second copy of the
weights), sampled with a seed drawn from the job's seed, the epoch and the batch (a resumed job draws the same),
scores them (`rewards.score`), normalises the rewards within each prompt's group (TRL's `scale_rewards="group"`:
`(r - mean) / (std + 1e-4)`, Bessel's std) and yields the rows `iterations` times, one optimizer step each (TRL's
`num_iterations`). With more than one iteration the old log-probs are computed once per generation batch before its
first step, and with `--kl-beta` the reference's with the LoRA adapters off (a forward-only pass each). The step's
rollout figures (reward mean and std, each function's mean, completion length) and a sample are read by the loop
(`step_metrics`, `rollout_sample`). A held-out evaluation (`held_out_rewards`) completes the first
`HELD_OUT_PROMPTS` held-out prompts greedily through the same stages and reports their mean reward (no loss: GRPO's
surrogate has no held-out meaning).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.errors import ConfigError
from pipetrain.generate.engine import EngineGenerator
from pipetrain.generate.job import eos_ids
from pipetrain.generate.prompts import left_pad
from pipetrain.generate.sampling import Sampling
from pipetrain.logs.records import MetricTotals
from pipetrain.lora import adapters_disabled
from pipetrain.objectives.columns import with_columns
from pipetrain.objectives.folder import FolderObjective
from pipetrain.objectives.grpo_loss import SurrogateLoss
from pipetrain.objectives.prompt_rows import GRPOSettings, PromptRows, check_generations, read_prompt_rows
from pipetrain.objectives.logps import token_logps
from pipetrain.objectives.rewards import load_rewards, score
from pipetrain.pipeline import PipelineEngine
from pipetrain.pipeline.loss import IGNORE_INDEX
from pipetrain.workloads.evaluation import evaluation_share
from pipetrain.workloads.hf.text import load_tokenizer
from pipetrain.workloads.hf.workload import HFWorkload
from pipetrain.workloads.position import replica_shares
from pipetrain.workloads.registry import Batch, DataRequest
from pipetrain.workloads.text.batching import batch_order

__all__ = ["GRPOWorkload", "HELD_OUT_PROMPTS"]

#: held-out prompts a training run's evaluation completes (greedy), at most: a bounded cost per evaluation
HELD_OUT_PROMPTS = 32


class GRPOWorkload(FolderObjective):
    """The `hf` workload of a model folder trained by GRPO (`settings`) on the prompts of its data."""

    metrics = ()
    windows = True
    needs_folder = ("--objective grpo trains a pretrained model folder on prompt rows",
                    "pass --workload hf --model DIR --data prompts.jsonl")
    settings: GRPOSettings

    def __init__(self, inner: HFWorkload, settings: GRPOSettings) -> None:
        super().__init__(inner, settings)
        self._metrics: dict[str, float] = {}
        self._sample: tuple[str, str] | None = None

    def load_data(self, request: DataRequest) -> tuple[PromptRows, PromptRows]:
        if request.synthetic or request.path is None:
            raise ConfigError("--objective grpo rolls out the prompts of --data: none was given",
                              hint="pass --data prompts.jsonl (rows with a 'prompt' field)")
        seq_len = request.seq_len or self.inner.window(request.preset, seq_len=None, synthetic=False)
        return read_prompt_rows(Path(request.path), load_tokenizer(self.inner.folder), seq_len=seq_len,
                                settings=self.settings)

    def before_training(self, engine: PipelineEngine, splits: dict, *, mesh: Any, batch_size: int,
                        store: Path | None, main: bool) -> None:
        """Bind the engine the rollouts generate with (every rank at once: it makes the generation's groups)."""
        model = engine.model  # (LoRA blocks pass the wrapped model's config and window through)
        self.engine, self.mesh, self.width = engine, mesh, model.seq_len + 1
        self.generator = EngineGenerator(engine, mesh, model.config, self.inner.folder)
        self.tokenizer = load_tokenizer(self.inner.folder)
        self.stops = set(eos_ids(self.inner.folder, model.config, self.tokenizer)) | {self.tokenizer.eos_token_id}
        pad = self.tokenizer.pad_token_id
        self.pad = pad if pad is not None else self.tokenizer.eos_token_id
        self.functions = load_rewards(self.settings.rewards)

    def batches(self, dataset: Any, batch_size: int, *, shuffle: bool, seed: int, epoch: int, replica: int,
                replicas: int, bucket: bool = False, start: int = 0) -> Iterator[Batch]:
        if not shuffle:  # evaluation: no rollouts of the held-out prompts during training
            return iter(())
        return self._rollouts(dataset, batch_size, seed=seed, epoch=epoch, replica=replica, replicas=replicas,
                              start=start)

    def _rollouts(self, data: PromptRows, batch_size: int, *, seed: int, epoch: int, replica: int, replicas: int,
                  start: int) -> Iterator[Batch]:
        per_step, iterations = batch_size // self.settings.generations, self.settings.iterations
        done, first = divmod(start // batch_size, iterations)
        order = batch_order(torch.tensor([len(i) for i in data.ids]), per_step, shuffle=True, bucket=False, seed=seed,
                            stream=f"grpo-epoch-{epoch}", bucket_stream=f"grpo-buckets-{epoch}")
        shares = replica_shares(order, per_step, replica=replica, replicas=replicas, start=done * per_step,
                                drop_last=True)
        for n, (_, share) in enumerate(shares):
            draw = hashlib.blake2b(f"grpo:{seed}:{epoch}:{done + n}".encode(), digest_size=8).digest()
            x, targets = self._rollout(data, share, int.from_bytes(draw, "little") >> 1)
            for _ in range(first if n == 0 else 0, iterations):
                yield x, targets

    def held_out_rewards(self, data: PromptRows, *, replica: int, replicas: int) -> MetricTotals:
        """The rewards of greedy completions of the first `HELD_OUT_PROMPTS` held-out prompts, generated through the
        training stages as the rollouts are: each replica completes an equal-size share of them
        (`evaluation_share`: every replica makes the same calls, its filler prompts past the end not scored), so
        each prompt counts once at any dp. Sums over the replicas in `extras` (`reward`, `rewards/<function>/mean`),
        `count` the prompts scored. Every rank calls it."""
        prompts = min(len(data.ids), HELD_OUT_PROMPTS)
        share, counted = evaluation_share(prompts, replica=replica, replicas=replicas)
        stats = torch.zeros(2 + len(self.functions), dtype=torch.float64)
        if len(share):  # (no held-out prompt at all: no replica generates)
            texts, completions = self._complete([data.ids[i] for i in share.tolist()], Sampling(),
                                                self.settings.max_completion_length)
            picks = share[:counted].tolist()
            if picks:
                per, rewards, _ = self._score(data, picks, texts[:counted], completions[:counted])
                finite = ~torch.isnan(rewards)
                stats = torch.tensor([float(rewards[finite].sum()), float(finite.sum()),
                                      *torch.nan_to_num(per).sum(0).tolist()], dtype=torch.float64)
        if self.mesh.dp > 1:
            stats = stats.to(self.engine.device)
            dist.all_reduce(stats, group=self.mesh.dp_group)
            stats = stats.cpu()
        total, n, *each_function = stats.tolist()
        scale = n / max(prompts, 1)  # the functions' means are over every prompt, as a step's
        extras = {"reward": total, **{f"rewards/{f.name}/mean": v * scale for f, v in zip(self.functions,
                                                                                           each_function)}}
        return MetricTotals(count=n, extras=extras if n else {})  # (none scored: no figure, not a 0)

    def _complete(self, prompt_ids: list[list[int]], sampling: Sampling,
                  tokens: int) -> tuple[list[str], list[list[int]]]:
        """(texts, token ids) of completions of `prompt_ids` through the engine's stages, each cut after its first
        stop token."""
        done = self.generator.generate(left_pad(prompt_ids, self.pad), sampling, tokens)
        completions = []
        for row in done.tokens.tolist():
            cut = next((k + 1 for k, t in enumerate(row) if t in self.stops), len(row))
            completions.append(row[:cut])
        return self.tokenizer.batch_decode(completions, skip_special_tokens=True), completions

    def _score(self, data: PromptRows, picks: list[int], texts: list[str],
               completions: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, list]:
        """(each function's rewards, their sum, the prompts) of the completions of rows `picks` (chat prompts get
        chat completions, as TRL gives them)."""
        prompts = [data.prompts[i] for i in picks]
        given = [[{"role": "assistant", "content": t}] for t in texts] if isinstance(prompts[0], list) else texts
        fields = {k: [data.fields[i][k] for i in picks] for k in data.fields[picks[0]]}
        per, rewards = score(self.functions, prompts, given, completions, fields, [data.rows[i] for i in picks])
        return per, rewards, prompts

    def _logps(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token log-probs of `labels` by the engine's weights now (NaN where no label, and off the last
        stage, which alone reads the targets)."""
        kept, self.engine.keep_outputs = self.engine.keep_outputs, True
        try:
            result = self.engine.evaluate(x, None)
        finally:
            self.engine.keep_outputs = kept
        out = torch.full(labels.shape, math.nan, dtype=torch.float64)
        if result.outputs is not None:
            logps, mask = token_logps(result.outputs / self.settings.loss.temperature, labels.to(result.outputs.device))
            out = torch.where(mask.bool(), logps.double(), math.nan).cpu()
        return out

    def _rollout(self, data: PromptRows, share: torch.Tensor, draw: int) -> Batch:
        g, settings = self.settings.generations, self.settings
        picks = [int(i) for i in share for _ in range(g)]
        prompt_ids = [data.ids[i] for i in picks]
        texts, completions = self._complete(
            prompt_ids, Sampling(temperature=settings.loss.temperature, top_p=settings.top_p, seed=draw),
            settings.max_completion_length)
        per, rewards, prompts = self._score(data, picks, texts, completions)
        groups = rewards.view(-1, g)
        mean = torch.nanmean(groups, dim=1, keepdim=True)
        std = torch.sqrt(torch.nanmean((groups - mean) ** 2, dim=1, keepdim=True) * g / (g - 1))
        advantages = torch.nan_to_num(((groups - mean) / (std + 1e-4)).flatten(), nan=0.0)
        ids = torch.full((len(picks), self.width), self.pad, dtype=torch.long)
        labels = torch.full((len(picks), self.width - 1), IGNORE_INDEX, dtype=torch.long)
        for r, (p, c) in enumerate(zip(prompt_ids, completions)):
            c = c[: self.width - len(p)]
            ids[r, : len(p) + len(c)] = torch.tensor(p + c)
            labels[r, len(p) - 1: len(p) - 1 + len(c)] = torch.tensor(c, dtype=torch.long)
        x = ids[:, :-1]
        nan = torch.full(labels.shape, math.nan, dtype=torch.float64)
        old = self._logps(x, labels) if settings.iterations > 1 else nan
        reference = nan
        if settings.loss.kl_beta:
            with adapters_disabled(self.engine.modules):
                reference = self._logps(x, labels)
        self._record(per, rewards, completions, prompts, texts)
        return x, with_columns(labels, torch.cat([old, reference, advantages[:, None].double()], dim=1))

    def _record(self, per: torch.Tensor, rewards: torch.Tensor, completions: list, prompts: list,
                texts: list[str]) -> None:
        """The step's rollout figures over every replica (reward mean and std, each function's mean, completion
        length) and this replica's first completion as the sample."""
        finite = ~torch.isnan(rewards)
        stats = torch.tensor([float(rewards[finite].sum()), float((rewards[finite] ** 2).sum()), float(finite.sum()),
                              float(sum(len(c) for c in completions)), float(len(completions)),
                              *torch.nan_to_num(per).sum(0).tolist()], dtype=torch.float64)
        if self.mesh.dp > 1:
            stats = stats.to(self.engine.device)
            dist.all_reduce(stats, group=self.mesh.dp_group)
            stats = stats.cpu()
        total, squares, n, length, count = stats[:5].tolist()
        mean = total / max(n, 1.0)
        self._metrics = {"reward": mean, "reward_std": math.sqrt(max(squares / max(n, 1.0) - mean ** 2, 0.0)
                                                                  * n / max(n - 1, 1.0)),
                         "completions/mean_length": length / max(count, 1.0)}
        for f, value in zip(self.functions, stats[5:].tolist()):
            self._metrics[f"rewards/{f.name}/mean"] = value / max(count, 1.0)
        prompt = prompts[0] if isinstance(prompts[0], str) else prompts[0][-1].get("content", "")
        self._sample = (str(prompt), f"{texts[0]!r} (reward {float(rewards[0]):.3g})")

    def step_metrics(self) -> dict[str, float]:
        """The last rollout's figures (the same on every rank)."""
        return dict(self._metrics)

    def rollout_sample(self) -> tuple[str, str] | None:
        """(prompt, completion and its reward) of the last rollout, on this replica."""
        return self._sample

    def num_batches(self, dataset: Any, batch_size: int, *, replicas: int) -> int:
        per_step = batch_size // self.settings.generations
        return (len(dataset.ids) // per_step) * self.settings.iterations

    def loss(self) -> SurrogateLoss:
        return SurrogateLoss(self.settings.loss)

    def describe_data(self, dataset: Any) -> str:
        return f"prompts rolled out {self.settings.generations} times, {self.inner.folder.name} tokenizer"

    def eval_split(self, dataset: Any) -> str:
        return "held-out"

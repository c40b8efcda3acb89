"""DPO through the pipeline equals TRL's `DPOTrainer` (and SimPO TRL's `CPOTrainer`) on the same batch.

A tiny Llama folder (2 layers, hidden 32, tied embeddings) and 4 preference pairs of unequal answer lengths. In one
process, TRL 1.13 builds its trainer on the folder (reference model: the folder's weights), collates the pairs and
computes its loss (`compute_loss`, which also logs rewards/chosen, rewards/rejected, rewards/margins and
rewards/accuracies) for `loss_type` sigmoid, ipo and robust (label smoothing 0.1); its backward gives every
gradient. SimPO: `CPOTrainer.cpo_loss` on the answers' mean log-probs of the transformers model. One spawned job of
4 ranks then runs, per layout, pipetrain's reference pass (`reference_logps`: forward only, through the same
stages) and one step per loss type on the same batch, rows interleaved chosen/rejected: pp2 1F1B and pp2
interleaved 1F1B (two pipelines of 2 ranks at once), and dp2 x pp2 1F1B with DDP (each replica two of the pairs).
The loss, the four reward metrics, the reference log-probs and every gradient equal TRL's within rtol 1e-5,
atol 4e-5 (the fp32 parity tolerance).

GRPO in the same job: TRL's `GRPOTrainer._compute_loss` on fixed completions of 4 prompts (prompts of one length,
completions right-padded to unequal lengths), advantages, old per-token log-probs far enough from the policy's
that some ratios are clipped, and reference log-probs (`loss_type` grpo with beta 0.04, temperature 0.7; dapo, TRL's
default, without KL) gives the loss and every gradient; pipetrain's `SurrogateLoss` on the same rows (prompt and
completion as one row, the numbers as float columns of the targets) gives them at the same three layouts, and the
KL and clip share as TRL logs them (dapo: both are token means).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from pipetrain.config import ParallelConfig, PipelineConfig  # noqa: E402
from pipetrain.launch.env import free_port  # noqa: E402
from pipetrain.launch.spawn import RankSpec, spawn  # noqa: E402
from pipetrain.objectives import DPOSettings, PreferenceLoss, PreferencePairs  # noqa: E402
from pipetrain.objectives.columns import with_columns  # noqa: E402
from pipetrain.objectives.grpo_loss import GRPOLossSettings, SurrogateLoss  # noqa: E402
from pipetrain.objectives.reference import reference_logps  # noqa: E402
from pipetrain.pipeline import PipelineEngine  # noqa: E402
from pipetrain.pipeline.loss import as_loss  # noqa: E402
from pipetrain.session import build_session, close_session, join_job  # noqa: E402
from pipetrain.workloads.hf.causal_lm import HFCausalLM  # noqa: E402
from tests.hf_folders import tiny_model_folder, transformers_names  # noqa: E402

RTOL, ATOL = 1e-5, 4e-5
SEED = 0
ROWS = [
    {"prompt": "The cat sat", "chosen": " on the mat.", "rejected": " on the log, it was the worst of times"},
    {"prompt": "It was the best", "chosen": " of times", "rejected": " of dogs."},
    {"prompt": "The capital of France is", "chosen": " Paris.", "rejected": " the age of wisdom, it was"},
    {"prompt": "abc", "chosen": "defghijklmnopqrstuvwxyz", "rejected": " ABC"},
]
#: loss case -> pipetrain settings
SETTINGS = {
    "sigmoid": DPOSettings(loss="sigmoid", beta=0.2),
    "ipo": DPOSettings(loss="ipo", beta=0.3),
    "robust": DPOSettings(loss="robust", beta=0.2, label_smoothing=0.1),
    "simpo": DPOSettings(loss="simpo", beta=2.0, label_smoothing=0.1, simpo_gamma=0.5),
}
#: layout -> (dp, pp, schedule, stages per rank, dp mode, tp)
LAYOUTS = {"pp2-1f1b": (1, 2, "1f1b", None, "ddp", 1), "pp2-interleaved": (1, 2, "interleaved-1f1b", 2, "ddp", 1),
           "dp2xpp2-1f1b": (2, 2, "1f1b", None, "ddp", 1), "dp2xpp2-1f1b-fsdp": (2, 2, "1f1b", None, "fsdp", 1),
           "tp2xpp2-1f1b": (1, 2, "1f1b", None, "fsdp", 2)}
#: the tied head's name -> the one tensor transformers lists
TIED = {"lm_head.weight": "model.embed_tokens.weight"}
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")


def _trainer(folder: Path, settings: DPOSettings, out: Path):
    import datasets

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    # bf16=False: TRL's configs default to bf16 autocast, which the reference model's forward would run under
    args = trl.DPOConfig(output_dir=str(out), report_to=[], use_cpu=True, bf16=False,
                         per_device_train_batch_size=len(ROWS), loss_type=[settings.loss], beta=settings.beta,
                         label_smoothing=settings.label_smoothing)
    trainer = trl.DPOTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(ROWS),
                             processing_class=tok)
    return trainer, model


def _simpo(model, batch: dict, settings: DPOSettings) -> tuple[torch.Tensor, dict]:
    """TRL's `CPOTrainer.cpo_loss` (SimPO, cpo_alpha 0) on the answers' mean log-probs of `model`."""
    from trl.experimental.cpo import CPOTrainer

    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["input_ids"].clone()
    labels[batch["completion_mask"] == 0] = -100
    logps = CPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
    chosen, rejected = logps.chunk(2)
    me = SimpleNamespace(alpha=0.0, loss_type="simpo", simpo_gamma=settings.simpo_gamma, beta=settings.beta,
                         label_smoothing=settings.label_smoothing, accelerator=SimpleNamespace(device="cpu"))
    losses, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(me, chosen, rejected)
    metrics = {"rewards/chosen": chosen_rewards.mean().item(), "rewards/rejected": rejected_rewards.mean().item(),
               "rewards/margins": (chosen_rewards - rejected_rewards).mean().item(),
               "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean().item()}
    return losses.mean(), metrics


def references(folder: Path, out: Path) -> tuple[dict, dict]:
    """(the collated batch, per loss case: TRL's loss, metrics, gradients and reference log-probs)."""
    found, batch = {}, None
    for name, settings in SETTINGS.items():
        trainer, model = _trainer(folder, SETTINGS["sigmoid"] if name == "simpo" else settings, out)
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(ROWS))])
        model.train()
        model.zero_grad()
        if name == "simpo":
            loss, metrics = _simpo(model, batch, settings)
        else:
            trainer._metrics["train"].clear()
            loss = trainer.compute_loss(model, batch)
            metrics = {k: trainer._metrics["train"][k][-1] for k in METRICS}
        loss.backward()
        with torch.no_grad():
            ref = torch.stack(trainer.compute_ref_log_probs(trainer.ref_model, batch), dim=1)
        found[name] = {"loss": loss.item(), "metrics": metrics, "reference": ref.double(),
                       "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}
    return {k: v for k, v in batch.items()}, found


#: GRPO case -> (pipetrain settings, TRL's GRPOConfig fields)
GRPO = {
    "grpo-kl": (GRPOLossSettings(loss="grpo", kl_beta=0.04, temperature=0.7),
                {"loss_type": "grpo", "beta": 0.04, "temperature": 0.7}),
    "dapo": (GRPOLossSettings(loss="dapo"), {"loss_type": "dapo", "beta": 0.0}),
}
P, C = 5, 6  # prompt and completion tokens


def rollout_inputs() -> dict:
    """Fixed completions of 4 prompts, their advantages, old and reference per-token log-probs (TRL's inputs)."""
    g = torch.Generator().manual_seed(2)
    completion_mask = torch.ones(4, C, dtype=torch.long)
    completion_mask[1, 4:] = 0
    completion_mask[3, 2:] = 0
    return {"prompt_ids": torch.randint(1, 200, (4, P), generator=g), "prompt_mask": torch.ones(4, P, dtype=torch.long),
            "completion_ids": torch.randint(1, 200, (4, C), generator=g), "completion_mask": completion_mask,
            "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5]),
            "old_per_token_logps": torch.randn(4, C, generator=g) * 0.3 - 5.6,
            "ref_per_token_logps": torch.randn(4, C, generator=g) * 0.3 - 5.6,
            "num_items_in_batch": completion_mask.sum()}


def grpo_references(folder: Path, out: Path) -> dict:
    """Per GRPO case: TRL's loss, KL and clip-share metrics and every gradient on `rollout_inputs()`."""
    import datasets

    def reward(prompts, completions, **kwargs):
        return [0.0] * len(prompts)

    found = {}
    for name, (_, fields) in GRPO.items():
        tok = transformers.AutoTokenizer.from_pretrained(folder)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder)
        args = trl.GRPOConfig(output_dir=str(out), report_to=[], use_cpu=True, bf16=False,
                              per_device_train_batch_size=4, num_generations=2, max_completion_length=C, **fields)
        trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=args, processing_class=tok,
                                  train_dataset=datasets.Dataset.from_list([{"prompt": "The cat"}] * 4))
        trainer.current_gradient_accumulation_steps = 1  # (set by its training loop)
        model.train()
        loss = trainer._compute_loss(model, rollout_inputs())
        loss.backward()
        logged = trainer._metrics["train"]
        metrics = {k: logged[k][-1] for k in ("kl", "clip_ratio/region_mean") if logged[k]}  # (no kl without beta)
        found[name] = {"loss": loss.item(), "metrics": metrics,
                       "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}
    return found


def rollout_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """`rollout_inputs()` as pipetrain rows: (input ids, targets: completion labels, old and reference log-probs,
    advantage); the log-probs sit under the labels they belong to, NaN elsewhere."""
    inputs = rollout_inputs()
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    labels = torch.full((4, P + C - 1), -100)
    labels[:, P - 1:] = inputs["completion_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
    old, ref = (torch.full((4, P + C - 1), float("nan"), dtype=torch.float64) for _ in range(2))
    old[:, P - 1:], ref[:, P - 1:] = inputs["old_per_token_logps"], inputs["ref_per_token_logps"]
    return ids[:, :-1], with_columns(labels, torch.cat([old, ref, inputs["advantages"][:, None].double()], dim=1))


def pairs_of(batch: dict) -> PreferencePairs:
    """TRL's collated batch (chosen rows, then rejected rows) as pipetrain pairs."""
    n = batch["input_ids"].shape[0] // 2
    tokens = torch.stack([batch["input_ids"][:n], batch["input_ids"][n:]], dim=1)
    trained = torch.stack([batch["completion_mask"][:n], batch["completion_mask"][n:]], dim=1).bool()
    lengths = torch.stack([batch["attention_mask"][:n].sum(1), batch["attention_mask"][n:].sum(1)], dim=1)
    return PreferencePairs(tokens, trained, lengths, torch.arange(n), 0, "TRL's batch")


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _layout(folder: str, name: str, device, pairs: list, seq: int):
    dp, pp, schedule, stages, mode, tp = LAYOUTS[name]
    model = HFCausalLM.from_folder(folder, seq_len=seq)
    pipeline = PipelineConfig(pp=pp, schedule=schedule, n_microbatches=2, stages_per_rank=stages)
    loss = PreferenceLoss(SETTINGS["sigmoid"])
    if dp == 1 and tp == 1:
        group = pairs[dist.get_rank() // 2]
        engine = PipelineEngine(model, pipeline, device=device, pp_group=group, loss_fn=loss, seed=SEED,
                                metrics_group=group)
        return model, engine, 0, 1, group
    session = build_session(model, ParallelConfig(dp=dp, dp_mode=mode, pipeline=pipeline, tp=tp), device, seed=SEED,
                            loss_fn=loss)
    return model, session.engine, session.mesh.dp_rank, dp, None


def _records(spec: RankSpec, folder: str, batch: dict, out: str) -> None:
    device = join_job(spec)
    try:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        records = {}
        for name in LAYOUTS:
            data = pairs_of(batch)
            model, engine, replica, dp, group = _layout(folder, name, device, pairs, data.tokens.shape[-1] - 1)
            keys = transformers_names(model)
            data.reference = reference_logps(engine, data, batch_size=2, dp_rank=replica, dp=dp, group=group)
            share = torch.arange(replica * len(data) // dp, (replica + 1) * len(data) // dp)
            x, targets = data.take(share)
            for case, settings in SETTINGS.items():
                engine.loss = as_loss(PreferenceLoss(settings))
                for p in engine.parameters():
                    p.grad = None
                result = engine.step(x, targets)
                records[name, case] = {
                    "loss": result.loss, "metrics": dict(result.extras), "reference": data.reference.clone(),
                    "grads": {keys[n]: _full(p.grad).clone() for n, p in engine.named_parameters()
                              if p.grad is not None}}
            model, engine, replica, dp, group = _layout(folder, name, device, pairs, P + C - 1)
            x, targets = rollout_rows()
            share = slice(replica * 4 // dp, (replica + 1) * 4 // dp)
            for case, (settings, _) in GRPO.items():
                engine.loss = as_loss(SurrogateLoss(settings))
                for p in engine.parameters():
                    p.grad = None
                result = engine.step(x[share], targets[share])
                records[name, case] = {"loss": result.loss, "metrics": dict(result.extras),
                                       "grads": {keys[n]: _full(p.grad).clone() for n, p in engine.named_parameters()
                                                 if p.grad is not None}}
        torch.save(records, Path(out) / f"rank{spec.rank}.pt")
    finally:
        close_session()


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("align")
    folder = tiny_model_folder(root / "llama", layers=2)
    batch, refs = references(folder, root / "trl")
    refs.update(grpo_references(folder, root / "trl-grpo"))
    spawn(_records, ranks=range(4), world_size=4, master_addr="127.0.0.1", master_port=free_port(),
          args=(str(folder), batch, str(root)), timeout_s=600)
    return [torch.load(root / f"rank{r}.pt") for r in range(4)], refs


@pytest.mark.parametrize("case", list(SETTINGS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dpo_loss_and_gradients_equal_trl(job, layout, case):
    per_rank, refs = job
    ref = refs[case]
    seen = set()
    for records in per_rank:
        got = records[layout, case]
        assert got["loss"] == pytest.approx(ref["loss"], rel=RTOL, abs=ATOL)
        for metric in METRICS:
            assert got["metrics"][metric] == pytest.approx(ref["metrics"][metric], rel=RTOL, abs=ATOL), metric
        torch.testing.assert_close(got["reference"], ref["reference"], rtol=RTOL, atol=ATOL)
        for name, grad in got["grads"].items():
            name = TIED.get(name, name)  # the head's copy of the tied embedding holds the summed gradient too
            torch.testing.assert_close(grad, ref["grads"][name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
            seen.add(name)
    assert seen == set(ref["grads"])  # every parameter's gradient, on some rank


@pytest.mark.parametrize("case", list(GRPO))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grpo_loss_and_gradients_equal_trl(job, layout, case):
    per_rank, refs = job
    ref = refs[case]
    seen = set()
    for records in per_rank:
        got = records[layout, case]
        assert got["loss"] == pytest.approx(ref["loss"], rel=RTOL, abs=ATOL)
        if case == "dapo":  # KL and clip share per token, as TRL logs them
            for metric, value in ref["metrics"].items():
                assert got["metrics"][metric] == pytest.approx(value, rel=RTOL, abs=ATOL), metric
        for name, grad in got["grads"].items():
            name = TIED.get(name, name)
            torch.testing.assert_close(grad, ref["grads"][name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
            seen.add(name)
    assert seen == set(ref["grads"])
    assert 0 < refs["dapo"]["metrics"]["clip_ratio/region_mean"] < 1  # some ratios clipped, not all

"""`pipetrain eval` at dp2 × pp2: the held-out loss equals the unsplit transformers model's on the same batches
(rtol 1e-5), and the answer accuracy is what transformers' greedy `generate` gives; the same rows packed by document
(`--pack documents`, at pp2) give the same loss and are still answered.

The data are 90 prompt/answer rows for a tiny Llama (3 layers, wide weights: see test_generate); the held-out
split is every 10th row (9 rows: batches of 4, 4 and 1, the last one's second replica without a sample). Five of
the held-out rows have as answer the unsplit model's own 3 greedy tokens for their prompt (decoded), the others an
answer it does not give: the accuracy must be exactly 5/9, which needs every answer generated through the pipeline
to be the unsplit model's (replica 0 answers 5 of them, replica 1 4).

The held-out figures at any dp (a spawned job of 4 ranks, several layouts): the training loop's evaluation and
`pipetrain eval`'s count every held-out sample once, giving the unsplit model's figures over all of them; in the same
job GRPO's held-out evaluation (greedy completions of the held-out prompts, scored) counts every prompt once too.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")

from pipetrain.checkpoint.durable import Position  # noqa: E402
from pipetrain.cli import main as cli_main  # noqa: E402
from pipetrain.config import ParallelConfig, PipelineConfig  # noqa: E402
from pipetrain.data.fields import RowFormat  # noqa: E402
from pipetrain.evaluate.run import held_out_loss  # noqa: E402
from pipetrain.generate.job import eos_ids  # noqa: E402
from pipetrain.launch.env import DEVICE_VARIABLE, free_port  # noqa: E402
from pipetrain.objectives import GRPOSettings  # noqa: E402
from pipetrain.launch.spawn import spawn  # noqa: E402
from pipetrain.session import build_session, close_session, join_job  # noqa: E402
from pipetrain.train.config import TrainConfig, load_data  # noqa: E402
from pipetrain.train.loop import _held_out  # noqa: E402
from tests.distributed.test_generate import wide_folder  # noqa: E402
from tests.hf_folders import tiny_model_folder  # noqa: E402

SEQ, NEW = 48, 3


def _rows(folder: str) -> list[dict]:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    rows = []
    for index in range(90):
        prompt = f"Review {index}: it was {'the best' if index % 3 else 'the worst'} of times. Verdict:"
        answer = " zebra quartz"
        if index % 10 == 9 and (index // 10) % 2 == 0:  # held out, and answered by the model itself
            ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                                 pad_token_id=0)
            answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        rows.append({"prompt": prompt, "completion": answer})
    return rows


def _unsplit_loss(folder: str, data) -> float:
    config = TrainConfig(workload="hf", model_dir=folder, data=data, seq_len=SEQ, batch_size=4,
                         row_format=RowFormat())
    _, test = load_data(config)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in config.task().batches(test, 4, shuffle=False, seed=0, epoch=0, replica=0, replicas=1):
            logits = model(x).logits  # the targets are the next tokens already (-100: not trained, padding)
            total += F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum").item()
            count += int((y != -100).sum())
    return total / count


def test_eval_loss_and_answer_accuracy_match_the_unsplit_model(tmp_path):
    folder = wide_folder(tmp_path / "llama", "llama")
    data = tmp_path / "sft.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in _rows(folder)) + "\n")
    out = tmp_path / "eval.json"
    assert cli_main.main(["eval", "--model", folder, "--data", str(data), "--seq-len", str(SEQ), "--batch-size", "4",
                          "--dp", "2", "--pp", "2", "--max-new-tokens", str(NEW), "--out", str(out),
                          "--device", "cpu"]) == 0
    figures = json.loads(out.read_text())
    expected = _unsplit_loss(folder, data)
    assert math.isclose(figures["loss"], expected, rel_tol=1e-5), (figures["loss"], expected)
    assert math.isclose(figures["perplexity"], math.exp(expected), rel_tol=1e-4)
    assert (figures["correct"], figures["answers"]) == (5, 9) and figures["answer_accuracy"] == 5 / 9
    # the rows packed by document (a `--pack documents` run's data): the same loss, and the answers still scored
    # (main skipped them: "the data holds plain text")
    assert cli_main.main(["eval", "--model", folder, "--data", str(data), "--seq-len", str(SEQ), "--batch-size", "4",
                          "--pp", "2", "--pack", "documents", "--max-new-tokens", str(NEW), "--out", str(out),
                          "--device", "cpu"]) == 0
    packed = json.loads(out.read_text())
    assert math.isclose(packed["loss"], expected, rel_tol=1e-5), (packed["loss"], expected)
    assert (packed["correct"], packed["answers"]) == (5, 9)


def test_eval_at_dp2_tp2_ends_when_the_held_out_rows_do_not_divide(tmp_path):
    """18 held-out rows in chunks of 8: replica 0 answers two chunks, replica 1 one. Under FSDP (dp 2 x tp 2) every
    generation gathers the weights over the replicas: replica 1 takes an empty turn, so both gather as often (fails
    on main by hanging; the job is ended by its process group after the timeout)."""
    import os
    import signal
    import subprocess
    import sys

    folder = wide_folder(tmp_path / "llama", "llama")
    rows = [{"prompt": f"Review {index}: it was {'good' if index % 3 else 'bad'}. Verdict:", "completion": " yes"}
            for index in range(180)]
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    out = tmp_path / "eval.json"
    command = [sys.executable, "-m", "pipetrain", "eval", "--model", folder, "--data", str(data), "--seq-len", "32",
               "--batch-size", "8", "--dp", "2", "--tp", "2", "--max-new-tokens", "2", "--out", str(out),
               "--device", "cpu"]
    job = subprocess.Popen(command, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    try:
        printed, _ = job.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        job.communicate()
        pytest.fail("pipetrain eval --dp 2 --tp 2 still ran after 240 s (a replica waits in a gather for good)")
    assert job.returncode == 0, printed
    figures = json.loads(out.read_text())
    assert figures["answers"] == 18 and figures["tokens"] > 0, figures


# --- held-out figures at any dp: one spawned job of 4 ranks runs every layout on two data files -----------------

#: data file -> its rows: every 10th row is held out, 3 and 5 rows in global batches of 4 (a last batch of 3 and
#: of 1 sample: at dp 4 one replica, and three, hold no sample of it)
HELD_OUT_ROWS = {"three": 30, "five": 50}
#: layout -> (dp, pp, cp, tp, dp_mode)
LAYOUTS = {"dp4": (4, 1, 1, 1, "ddp"), "dp4-fsdp": (4, 1, 1, 1, "fsdp"), "dp2xpp2": (2, 2, 1, 1, "ddp"),
           "dp2xcp2": (2, 1, 2, 1, "ddp"), "dp2xtp2": (2, 1, 1, 2, "fsdp")}
HELD_SEQ, HELD_BATCH = 64, 4


def _held_out_config(folder: str, data: str, layout: str = "dp1") -> TrainConfig:
    dp, pp, cp, tp, mode = LAYOUTS.get(layout, (1, 1, 1, 1, "ddp"))
    pipeline = PipelineConfig(pp=pp, n_microbatches=HELD_BATCH // dp)  # a replica's share cut to single samples
    parallel = ParallelConfig(dp=dp, dp_mode=mode, cp=cp, tp=tp, pipeline=pipeline)
    return TrainConfig(workload="hf", model_dir=folder, data=data, seq_len=HELD_SEQ, batch_size=HELD_BATCH,
                       parallel=parallel, row_format=RowFormat())


def _held_out_worker(spec, folder: str, files: dict[str, str], out: str, grpo: tuple[str, str]) -> None:
    """Each (data, layout): the training loop's held-out figures (`_held_out`, what an evaluation during training
    logs) and `pipetrain eval`'s (`held_out_loss`), on the folder's weights; then GRPO's held-out rewards (`grpo`:
    its folder and reward file) at each of `GRPO_LAYOUTS`."""
    device = join_job(spec)
    nowhere = SimpleNamespace(progress=lambda: None, stop_requested=lambda: False)
    try:
        records = {}
        for name, data in files.items():
            for layout in LAYOUTS:
                config = _held_out_config(folder, data, layout)
                workload = config.task()
                _, test = load_data(config)
                session = build_session(config.model(), config.parallel, device, loss_fn=workload.loss())
                tested, record = _held_out(session.engine, workload, test, config, session.mesh.dp_rank, nowhere,
                                           Position(step=1, epoch=1), "epoch")
                records[name, layout] = {"training": (record.loss, record.accuracy, int(tested.count), record.batches),
                                         "eval": held_out_loss(session, config, test)}
            for layout in GRPO_LAYOUTS:
                config = _grpo_config(*grpo, data, layout)
                workload = config.task()
                train, test = load_data(config)
                session = build_session(config.model(), config.parallel, device, loss_fn=workload.loss())
                workload.before_training(session.engine, {"train": train, "test": test}, mesh=session.mesh,
                                         batch_size=config.batch_size, store=None, main=spec.rank == 0)
                tested, record = _held_out(session.engine, workload, test, config, session.mesh.dp_rank, nowhere,
                                           Position(step=1, epoch=1), "epoch")
                records[name, "grpo", layout] = (record.loss, int(tested.count), record.extras)
        torch.save(records, f"{out}/rank{spec.rank}.pt")
    finally:
        close_session()


def _one_rank_figures(folder: str, data: str) -> tuple[float, float, int]:
    """(loss, token accuracy, tokens) of every held-out sample through the unsplit transformers model (float64
    sums of its fp32 per-token losses)."""
    config = _held_out_config(folder, data)
    _, test = load_data(config)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    total, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for x, y in config.task().batches(test, HELD_BATCH, shuffle=False, seed=0, epoch=0, replica=0, replicas=1):
            logits, keep = model(x).logits, y != -100
            total += F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum").double()
            correct += int((logits.argmax(-1)[keep] == y[keep]).sum())
            count += int(keep.sum())
    return float(total) / count, correct / count, count


#: GRPO's held-out evaluation at these layouts (4 and 2 replicas, DDP and FSDP, beside pp and tp)
GRPO_LAYOUTS = ("dp4", "dp4-fsdp", "dp2xpp2", "dp2xtp2")
GRPO_NEW, GRPO_BATCH = 4, 8
#: reward functions of the held-out prompts: one of each completion's text (its code points), one of its prompt alone (a prompt left
#: out or counted twice moves its mean whatever the generation gives)
REWARDS = """
def chars(prompts, completions, **kwargs):
    return [float(sum(map(ord, c)) % 1000) for c in completions]


def worst(prompts, completions, **kwargs):
    return [1.0 if "worst" in p else 0.0 for p in prompts]
"""


def _grpo_config(folder: str, rewards: str, data: str, layout: str = "dp1") -> TrainConfig:
    dp, pp, cp, tp, mode = LAYOUTS.get(layout, (1, 1, 1, 1, "ddp"))
    settings = GRPOSettings(rewards=(f"{rewards}:chars", f"{rewards}:worst"), generations=2,
                            max_completion_length=GRPO_NEW)
    parallel = ParallelConfig(dp=dp, dp_mode=mode, cp=cp, tp=tp, pipeline=PipelineConfig(pp=pp, n_microbatches=2))
    return TrainConfig(workload="hf", model_dir=folder, data=data, seq_len=HELD_SEQ, batch_size=GRPO_BATCH,
                       parallel=parallel, objective=settings)


def _one_rank_rewards(folder: str, rewards: str, data: str) -> tuple[int, float, float, float]:
    """(prompts, reward mean, `chars`'s mean, `worst`'s mean) of transformers' greedy completions of every held-out
    prompt, one at a time (no padding), each cut after its first stop token, scored in this process."""
    config = _grpo_config(folder, rewards, data)
    _, test = load_data(config)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    stops = set(eos_ids(Path(folder), model.config, tokenizer)) | {tokenizer.eos_token_id}
    chars, worst = [], []
    with torch.no_grad():
        for prompt, ids in zip(test.prompts, test.ids):
            given = torch.tensor([ids])
            out = model.generate(given, attention_mask=torch.ones_like(given), max_new_tokens=GRPO_NEW,
                                 do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
            cut = next((k + 1 for k, t in enumerate(out) if t in stops), len(out))
            chars.append(float(sum(map(ord, tokenizer.decode(out[:cut], skip_special_tokens=True))) % 1000))
            worst.append(1.0 if "worst" in prompt else 0.0)
    n = len(test.ids)
    return n, (sum(chars) + sum(worst)) / n, sum(chars) / n, sum(worst) / n


@pytest.fixture(scope="module")
def held_out_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("held-out")
    folder = str(tiny_model_folder(root / "llama", "llama"))
    grpo = (wide_folder(root / "wide", "llama"), str(root / "held_out_rewards.py"))
    Path(grpo[1]).write_text(REWARDS)
    files = {}
    for name, count in HELD_OUT_ROWS.items():
        rows = [{"prompt": f"Review {i}: it was {'the best' if i % 3 else 'the worst'} of times. Verdict:",
                 "completion": " good" if i % 2 else " bad"} for i in range(count)]
        files[name] = str(root / f"{name}.jsonl")
        Path(files[name]).write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.MonkeyPatch.context() as patch:  # the module's fixture runs before conftest's per-test pin
        patch.setenv(DEVICE_VARIABLE, "cpu")
        spawn(_held_out_worker, ranks=range(4), world_size=4, master_addr="127.0.0.1", master_port=free_port(),
              args=(folder, files, str(root), grpo), timeout_s=600)
    references = {name: _one_rank_figures(folder, data) for name, data in files.items()}
    references.update({(name, "grpo"): _one_rank_rewards(*grpo, data) for name, data in files.items()})
    return [torch.load(root / f"rank{r}.pt") for r in range(4)], references


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("data", list(HELD_OUT_ROWS))
def test_held_out_figures_at_any_layout_are_the_one_rank_figures(held_out_runs, data, layout):
    """Every held-out sample counted once at dp 2 and 4 (beside pp, cp, tp, FSDP): the training loop's figures equal
    `pipetrain eval`'s (rtol 1e-12: one code path) and the unsplit model's over every sample (the same token count,
    exactly; loss rtol 1e-6, accuracy equal) on every rank. Main's equal shares skipped a short last batch's
    remainder (its 5 rows at dp 2 counted 4, its 3 rows at dp 4 none: fewer tokens, another loss)."""
    per_rank, references = held_out_runs
    loss, accuracy, tokens = references[data]
    for records in per_rank:
        got = records[data, layout]
        trained_loss, trained_accuracy, trained_tokens, batches = got["training"]
        held = HELD_OUT_ROWS[data] // 10
        assert (trained_tokens, got["eval"][2], batches) == (tokens, tokens, -(-held // HELD_BATCH))
        assert trained_loss == pytest.approx(loss, rel=1e-6) and trained_accuracy == pytest.approx(accuracy, rel=1e-9)
        assert got["eval"][:2] == pytest.approx((trained_loss, trained_accuracy), rel=1e-12)


@pytest.mark.parametrize("layout", GRPO_LAYOUTS)
@pytest.mark.parametrize("data", list(HELD_OUT_ROWS))
def test_grpo_held_out_rewards_count_every_prompt_once(held_out_runs, data, layout):
    """GRPO's held-out evaluation of 3 and 5 prompts at dp 4 and dp 2 (DDP and FSDP) counts every prompt once and
    gives the one-process figures on every rank: the count exact, and the reward means equal (rel 1e-12: greedy
    tokens through the same weights, the same texts; only the sums' order differs). Main's equal shares dropped the
    remainder (5 prompts at dp 2 scored 4, 3 at dp 4 none), so the count and the `worst` mean (of the prompts
    alone) differed."""
    per_rank, references = held_out_runs
    prompts, reward, chars, worst = references[data, "grpo"]
    assert prompts == HELD_OUT_ROWS[data] // 10
    for records in per_rank:
        loss, count, extras = records[data, "grpo", layout]
        assert loss is None and count == prompts
        assert extras == pytest.approx({"reward": reward, "rewards/chars/mean": chars, "rewards/worst/mean": worst},
                                       rel=1e-12)

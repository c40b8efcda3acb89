"""Generation through the pipeline equals transformers' `generate` on the unsplit model, token for token.

A tiny Llama (3 layers, GQA) and a tiny GPT-2 (3 layers), with weights drawn wide enough that every prompt gets
varied tokens, and 4 prompts of different lengths (left-padded into one batch). One spawned job of 4 ranks:
first one SGD step of the Llama at dp2 × pp2, saved as a checkpoint; then pp2 (ranks 0-1 the Llama, ranks 2-3
GPT-2, side by side) and pp2 × tp2 (all 4) each generate 12 new tokens: greedy from the folders, greedy from the
checkpoint (`--checkpoint`), and sampled (temperature 0.8, top-p 0.9, seed 7). References, in this process:
`model.generate(ids, attention_mask=mask)` greedy; for the checkpoint, the checkpoint exported with `export_hf`
and loaded by transformers; for sampling, `torch.manual_seed(7)` then `generate(do_sample=True, temperature=0.8,
top_p=0.9, top_k=0)`, whose draws the seeded sampler reproduces. Every rank's tokens must be equal (exact).
The CLI runs `pipetrain generate --pp 2` once (the text and tokens/s printed, the one-line errors). A tiny Granite
(embedding x 12, logits / 8) and a tiny Cohere (logits x 0.25, one norm before attention and MLP side by side)
generate at pp2 × tp2, greedy and sampled: what they do outside the layers reaches the sampler as transformers'.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import torch.distributed as dist  # noqa: E402

from pipetrain.checkpoint.state import save_checkpoint  # noqa: E402
from pipetrain.cli import main as cli_main  # noqa: E402
from pipetrain.config import ParallelConfig, PipelineConfig  # noqa: E402
from pipetrain.generate.job import GenerateJob, build_stage, generate_batch, prepare_job  # noqa: E402
from pipetrain.generate.loop import Placement  # noqa: E402
from pipetrain.generate.sampling import Sampling  # noqa: E402
from pipetrain.generate.weights import model_source  # noqa: E402
from pipetrain.launch.env import free_port  # noqa: E402
from pipetrain.launch.spawn import RankSpec, spawn  # noqa: E402
from pipetrain.parallel.mesh import build_mesh  # noqa: E402
from pipetrain.session import build_session, close_session, join_job  # noqa: E402
from pipetrain.workloads.hf.causal_lm import HFCausalLM, causal_lm_loss  # noqa: E402
from pipetrain.workloads.hf.export import export_hf  # noqa: E402
from tests.hf_folders import scaled_configs, tiny_model_folder, tiny_tokenizer  # noqa: E402

PROMPTS = ("The cat", "It was the best of times, it was the worst of", "abc",
           "The capital of France is Paris. The dog sat")
NEW = 12
SCALED = ("granite", "cohere")  # families that scale the embedding or the logits outside their layers
SAMPLED = Sampling(temperature=0.8, top_p=0.9, seed=7)


def wide_folder(folder: Path, family: str) -> str:
    """A tiny folder (3 layers, its tokenizer) whose matrices are redrawn with std 0.3: transformers' init (0.02)
    makes a tiny random model repeat one token, which would hide a wrong position or mask."""
    tiny_model_folder(folder, family, layers=3)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.3, generator=gen)
    model.save_pretrained(folder)
    return str(folder)


def wide_scaled_folder(folder: Path, family: str) -> str:
    """`scaled_configs`' Granite or Cohere (what they do outside the layers switched on: Granite's embedding x 12 and
    logits / 8, Cohere's logits x 0.25), with the tiny tokenizer, matrices redrawn with std 0.3 as `wide_folder`."""
    tokenizer = tiny_tokenizer()
    config = scaled_configs(len(tokenizer))[family]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.3, generator=gen)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _job(folder: str | None, checkpoint: str | None = None, sampling: Sampling = Sampling(), pp: int = 2,
         tp: int = 1) -> GenerateJob:
    return GenerateJob(model_source(folder, checkpoint), PROMPTS, pp=pp, tp=tp, max_new_tokens=NEW,
                       sampling=sampling)


def _run(job: GenerateJob, where: Placement, device, group=None, tp_mesh=None) -> torch.Tensor:
    model, batch = prepare_job(job)
    stage = build_stage(model, where, device, checkpoint=job.source.checkpoint, tp_mesh=tp_mesh)
    return generate_batch(job, stage, where, batch, model, group=group).tokens


def _train_and_save(folder: str, root: Path, device) -> None:
    """One SGD step of the Llama at dp2 × pp2 (1F1B), saved as an hf workload's checkpoint."""
    model = HFCausalLM.from_folder(folder, seq_len=8)
    session = build_session(model, ParallelConfig(dp=2, pipeline=PipelineConfig(pp=2, schedule="1f1b",
                                                                                      n_microbatches=2)),
                            device, loss_fn=causal_lm_loss)
    opt = torch.optim.SGD(session.engine.parameters(), lr=0.5)
    ids = (torch.arange(4 * 8).reshape(4, 8) * 7) % 200
    share = slice(2 * session.mesh.dp_rank, 2 * session.mesh.dp_rank + 2)
    session.engine.step(ids[share], ids[share])
    opt.step()
    save_checkpoint(root / "ckpt", session.engine, opt, step=1, model_name="hf:model",
                    config={"workload": "hf", "preset": "model", "model_dir": folder})


def _worker(spec: RankSpec, folders: dict[str, str], root: str) -> None:
    device = join_job(spec)
    out: dict[str, torch.Tensor] = {}
    try:
        _train_and_save(folders["llama"], Path(root), device)
        checkpoint = str(Path(root) / "ckpt")
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        pair, first = pairs[spec.rank // 2], 2 * (spec.rank // 2)
        where = Placement(spec.rank, pp=2, first=first)
        family = "llama" if first == 0 else "gpt2"
        out[f"{family}-pp2"] = _run(_job(folders[family]), where, device, pair)
        if family == "llama":
            out["ckpt-pp2"] = _run(_job(None, checkpoint), where, device, pair)
        else:
            out["gpt2-pp2-sampled"] = _run(_job(folders["gpt2"], sampling=SAMPLED), where, device, pair)
        mesh = build_mesh(1, 2, device, 2)
        where = Placement(spec.rank, pp=2, tp=2)
        for family in ("llama", "gpt2"):
            out[f"{family}-pp2xtp2"] = _run(_job(folders[family], tp=2), where, device, tp_mesh=mesh.tp_mesh)
        out["ckpt-pp2xtp2"] = _run(_job(None, checkpoint, tp=2), where, device, tp_mesh=mesh.tp_mesh)
        out["llama-pp2xtp2-sampled"] = _run(_job(folders["llama"], sampling=SAMPLED, tp=2), where, device,
                                            tp_mesh=mesh.tp_mesh)
        for family in SCALED:  # what the family does outside its layers, in the generation stages too
            out[f"{family}-pp2xtp2"] = _run(_job(folders[family], tp=2), where, device, tp_mesh=mesh.tp_mesh)
            out[f"{family}-pp2xtp2-sampled"] = _run(_job(folders[family], sampling=SAMPLED, tp=2), where, device,
                                                    tp_mesh=mesh.tp_mesh)
        torch.save(out, Path(root) / f"rank{spec.rank}.pt")
    finally:
        close_session()


def _reference(folder: str, sampling: Sampling = Sampling(), *, tokenizer_of: str | None = None) -> torch.Tensor:
    """transformers' `generate` on the unsplit model of `folder` (the prompts tokenized by `tokenizer_of`'s)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    batch = prepare_job(_job(tokenizer_of or folder, pp=1))[1]
    options = {"do_sample": False}
    if not sampling.greedy:
        torch.manual_seed(sampling.seed)
        options = {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": 0}
    out = model.generate(batch.ids, attention_mask=batch.mask, max_new_tokens=NEW, pad_token_id=0, **options)
    return out[:, batch.ids.shape[1]:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    folders = {family: wide_folder(root / family, family) for family in ("llama", "gpt2")}
    folders.update({family: wide_scaled_folder(root / family, family) for family in SCALED})
    spawn(_worker, ranks=range(4), world_size=4, master_addr="127.0.0.1", master_port=free_port(),
          args=(folders, str(root)), timeout_s=600)
    export_hf(root / "ckpt", HFCausalLM.from_folder(folders["llama"]), root / "exported")
    references = {f"{family}-{layout}": _reference(folders[family]) for family in ("llama", "gpt2")
                  for layout in ("pp2", "pp2xtp2")}
    for family in SCALED:
        references[f"{family}-pp2xtp2"] = _reference(folders[family])
        references[f"{family}-pp2xtp2-sampled"] = _reference(folders[family], SAMPLED)
    references["ckpt-pp2"] = references["ckpt-pp2xtp2"] = _reference(str(root / "exported"),
                                                                           tokenizer_of=folders["llama"])
    references["gpt2-pp2-sampled"] = _reference(folders["gpt2"], SAMPLED)
    references["llama-pp2xtp2-sampled"] = _reference(folders["llama"], SAMPLED)
    return [torch.load(root / f"rank{rank}.pt") for rank in range(4)], references, folders


CASES = ["llama-pp2", "gpt2-pp2", "ckpt-pp2", "gpt2-pp2-sampled", "llama-pp2xtp2", "gpt2-pp2xtp2", "ckpt-pp2xtp2",
         "llama-pp2xtp2-sampled", *(f"{family}-pp2xtp2{kind}" for family in ("granite", "cohere")
                                    for kind in ("", "-sampled"))]


@pytest.mark.parametrize("case", CASES)
def test_pipelined_generation_equals_transformers_generate(case, runs):
    per_rank, references, _ = runs
    expected = references[case]
    held = [records[case] for records in per_rank if case in records]
    assert len(held) == (4 if "xtp2" in case else 2)
    for tokens in held:
        assert torch.equal(tokens, expected), f"{case}:\n{tokens}\n!= transformers'\n{expected}"
    assert len(set(expected.flatten().tolist())) > NEW, "the reference repeats itself: a weak check"


def test_the_checkpoint_generates_other_tokens_than_its_base(runs):
    _, references, _ = runs
    assert not torch.equal(references["ckpt-pp2"], references["llama-pp2"])


def test_generate_command_prints_the_texts_and_speed(runs, tmp_path, capfd):
    _, references, folders = runs
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    assert cli_main.main(["generate", "--model", folders["gpt2"], "--prompts", str(prompts), "--pp", "2",
                          "--max-new-tokens", str(NEW), "--device", "cpu"]) == 0
    captured = capfd.readouterr()
    printed = captured.out
    tokenizer = transformers.AutoTokenizer.from_pretrained(folders["gpt2"])
    for index, row in enumerate(references["gpt2-pp2"]):
        assert f"[{index + 1}] {PROMPTS[index]}\n--> {tokenizer.decode(row, skip_special_tokens=True)}" in printed
    # the figures on standard error: a script reading the texts gets the texts only
    assert f"{4 * NEW} tokens (4 prompts x {NEW} steps)" in captured.err and "tokens/s at pp=2 tp=1" in captured.err
    assert "tokens/s" not in printed


def test_train_samples_every_n_steps_through_its_stages(runs, tmp_path, capfd):
    """`--sample-every 1` at pp2 (lr 1e-12: the weights stay the folder's to far below the logits' rounding): each
    step's sample is transformers' greedy continuation of the prompt, in the console and in TensorBoard."""
    _, _, folders = runs
    folder = folders["llama"]
    argv = ["train", "--workload", "hf", "--model", folder, "--data", "synthetic", "--seq-len", "16",
            "--batch-size", "4", "--max-steps", "2", "--pp", "2", "--chunks", "2", "--lr", "1e-12",
            "--sample-every", "1", "--sample-prompt", "The cat", "--sample-tokens", "8", "--no-progress",
            "--run-dir", str(tmp_path / "run"), "--device", "cpu"]
    tensorboard = importlib.util.find_spec("tensorboard") is not None
    if tensorboard:
        argv += ["--tensorboard", str(tmp_path / "tb")]
    capfd.readouterr()
    assert cli_main.main(argv) == 0
    printed = capfd.readouterr()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tokenizer("The cat", return_tensors="pt")["input_ids"]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, pad_token_id=0)
    text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    for step in (1, 2):
        assert f"sample at step {step}: The cat -> {text!r}" in printed.out + printed.err
    if tensorboard:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(tmp_path / "tb"))
        events.Reload()
        assert "samples/text_summary" in events.Tags()["tensors"]
        assert [e.step for e in events.Tensors("samples/text_summary")] == [1, 2]

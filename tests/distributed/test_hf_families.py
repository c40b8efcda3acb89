"""Every added Hugging Face family (Qwen2, Qwen3, Mistral, Gemma, Phi-3, OLMo-2, Granite, Cohere, Cohere 2, Gemma 2,
Gemma 3), pipelined, equals the unsplit transformers model; its checkpoint exports to a folder transformers loads;
`pipetrain check` passes it.

Each family's tiny random folder is made here with its own config class (`tests.hf_folders.family_configs`: 2
layers, hidden 32, 4 query and 2 key/value heads; Qwen2 with a sliding layer, Mistral sliding over 4 tokens, Phi-3
with partial rotary tables; Gemma tied, as by default; Granite with embedding multiplier 12 and logits divisor 8,
Cohere and Cohere 2 with logit scale 0.25, Gemma 2 and 3 soft-capped at 0.5 with a sliding and a global layer) and
the tiny tokenizer. One spawned job of 4 ranks runs, per
family: pp2 1F1B and pp2 interleaved 1F1B (two virtual stages per rank; two pipelines of 2 ranks), dp2 × pp2 with
FSDP2 (1F1B) and pp2 × tp2 (1F1B). Over test_hf_parity's three SGD steps (a full batch, a short right-padded one,
one smaller than the 4 micro-batches): the loss on every rank, every gradient at every step and every final
parameter equal `model(input_ids, labels=labels).loss`'s within rtol 1e-5, atol 4e-5 (Gemma's tied head: its copy
against the tied tensor, whose gradient sums both uses). The same job runs Qwen3 at pp2 × tp2 with its q/k norm
removed from its description: the norms' gradients then miss the other rank's heads, and the test asserts they
differ (the detail of the description is what makes it exact). The pp2 1F1B checkpoint of each family is exported
with `pipetrain export CKPT OUT --hf`; `AutoModelForCausalLM.from_pretrained(OUT)` gives the unsplit model's
logits after the same steps, and so do pipetrain's blocks built from OUT. `pipetrain check` (2 steps, pp2 1F1B, 2
chunks, its own tolerances) passes every family, and a tiny Arcee on the generic description, in one job of 2 ranks
(what the command runs).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from pipetrain.blocks import build_sequential  # noqa: E402
from pipetrain.check import run_checks  # noqa: E402
from pipetrain.checkpoint.state import save_checkpoint  # noqa: E402
from pipetrain.cli import main as cli_main  # noqa: E402
from pipetrain.config import ParallelConfig, PipelineConfig  # noqa: E402
from pipetrain.launch.env import free_port  # noqa: E402
from pipetrain.launch.spawn import RankSpec, spawn  # noqa: E402
from pipetrain.pipeline import PipelineEngine  # noqa: E402
from pipetrain.session import close_session, join_job  # noqa: E402
from pipetrain.train.loop import TrainConfig, load_data  # noqa: E402
from pipetrain.workloads.hf.causal_lm import HFCausalLM  # noqa: E402
from pipetrain.workloads.hf.families import FAMILIES  # noqa: E402
from tests.distributed.test_hf_parity import (ATOL, LR, RTOL, SEED, SEQ, _full, compare_records,  # noqa: E402
                                             layout_engine, make_batches, reference, sgd_steps)
from tests.hf_folders import family_configs, tiny_tokenizer, transformers_names  # noqa: E402

#: case -> (dp, dp mode, pp, tp, schedule, stages per rank); "pp2" cases run two pipelines of 2 ranks
LAYOUTS = {
    "pp2-1f1b": (1, "ddp", 2, 1, "1f1b", None),
    "pp2-interleaved": (1, "ddp", 2, 1, "interleaved-1f1b", 2),
    "dp2xpp2-fsdp": (2, "fsdp", 2, 1, "1f1b", None),
    "pp2xtp2": (1, "ddp", 2, 2, "1f1b", None),
}
NO_QK_NORM = "qwen3-pp2xtp2-without-qk-norm"  # Qwen3's description without its q/k norm


def _engine(model: HFCausalLM, layout: str, device: torch.device, pairs: list) -> tuple[PipelineEngine, int]:
    return layout_engine(model, LAYOUTS[layout], device, pairs)


def _train(folder: str, layout: str, device: torch.device, pairs: list, save: Path | None) -> dict:
    dp = LAYOUTS[layout][0]
    model = HFCausalLM.from_folder(folder, seq_len=SEQ)
    engine, replica = _engine(model, layout, device, pairs)
    tied = model.family.embed + ".weight"
    keys = {n: tied if model.tied and hf == "lm_head.weight" else hf for n, hf in transformers_names(model).items()}
    opt = torch.optim.SGD(engine.parameters(), lr=LR)
    losses, grads = sgd_steps(engine, opt, keys, replica, dp)
    if save is not None:
        save_checkpoint(save, engine, opt, step=len(losses))
    return {"losses": losses, "grads": grads, "params": [(keys[n], _full(p.detach()).clone())
                                                         for n, p in engine.named_parameters()],
            "split": {keys[n]: tuple(p.to_local().shape) for n, p in engine.named_parameters()
                      if isinstance(p, DTensor)}}


def _worker(spec: RankSpec, folders: dict[str, str], out: str) -> None:
    device = join_job(spec)
    try:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        records = {f"{family}-{layout}": _train(folder, layout, device, pairs,
                                                Path(out) / "ckpt" / family if layout == "pp2-1f1b" else None)
                   for family, folder in folders.items() for layout in LAYOUTS}
        FAMILIES["qwen3"] = dataclasses.replace(FAMILIES["qwen3"], qk_norm=None)  # this process only
        records[NO_QK_NORM] = _train(folders["qwen3"], "pp2xtp2", device, pairs, None)
        torch.save(records, Path(out) / f"rank{spec.rank}.pt")
    finally:
        close_session()


def family_folders(root: Path) -> dict[str, str]:
    """Each family's tiny random folder (seed 0) with the tiny tokenizer (a `--model DIR` folder)."""
    tokenizer, folders = tiny_tokenizer(), {}
    for family, config in family_configs(len(tokenizer)).items():
        torch.manual_seed(SEED)
        folders[family] = str(root / family)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folders[family])
        tokenizer.save_pretrained(folders[family])
    return folders


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    folders = family_folders(root)
    references = {}
    for family, folder in folders.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(folder)
        initial = {n: p.detach().clone() for n, p in model.state_dict().items()}
        for dp in (1, 2):
            model.load_state_dict(initial)
            references[family, dp] = reference(model, dp)
    spawn(_worker, ranks=range(4), world_size=4, master_addr="127.0.0.1", master_port=free_port(),
          args=(folders, str(root)), timeout_s=600)
    return [torch.load(root / f"rank{r}.pt") for r in range(4)], references, folders, root


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", sorted(family_configs()))
def test_pipelined_family_matches_the_unsplit_transformers_model(family, layout, runs):
    per_rank, references, _, _ = runs
    ref = references[family, LAYOUTS[layout][0]]
    seen = compare_records([records[f"{family}-{layout}"] for records in per_rank], ref)
    assert seen == set(ref["params"]), f"parameters held by no rank: {sorted(set(ref['params']) - seen)}"
    moved = max((ref["params"][n] - ref["initial"][n]).abs().max().item() for n in ref["params"])
    assert moved > 100 * ATOL, f"the reference's parameters barely moved ({moved})"
    if layout == "pp2xtp2":  # the MLP's down projection [32, 64] really is split by its input columns
        split = {name: shape for records in per_rank for name, shape in records[f"{family}-{layout}"]["split"].items()}
        assert split["model.layers.0.mlp.down_proj.weight"] == (32, 32), split


def test_gemma_is_tied_across_stages(runs):
    per_rank, _, folders, _ = runs
    assert HFCausalLM.from_folder(folders["gemma"], seq_len=SEQ).tied
    for layout in LAYOUTS:  # the embedding's copy (first stage) and the head's (last stage) end equal
        copies = [value for records in per_rank for name, value in records[f"gemma-{layout}"]["params"]
                  if name == "model.embed_tokens.weight"]
        assert len(copies) >= 2 and all(torch.equal(copies[0], c) for c in copies[1:]), layout


def test_qwen3_without_its_q_k_norm_in_the_description_is_not_exact_under_tp(runs):
    per_rank, references, _, _ = runs
    with pytest.raises(AssertionError, match=r"gradient of model\.layers\.\d\.self_attn\.[qk]_norm\.weight"):
        compare_records([records[NO_QK_NORM] for records in per_rank], references["qwen3", 1])


@pytest.mark.parametrize("family", sorted(family_configs()))
def test_export_hf_round_trip_gives_the_trained_logits(family, runs, tmp_path, capsys):
    _, references, folders, root = runs
    out = tmp_path / "exported"
    code = cli_main.main(["export", str(root / "ckpt" / family), str(out), "--hf", "--workload", "hf",
                          "--preset", "llama-tiny", "--model", folders[family]])
    assert code == 0, capsys.readouterr()
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(exported).__name__ == type(transformers.AutoModelForCausalLM.from_pretrained(folders[family])).__name__
    trained = transformers.AutoModelForCausalLM.from_pretrained(folders[family]).eval()
    ids = make_batches()[0][0]
    with torch.no_grad():
        before = trained(input_ids=ids).logits
        trained.load_state_dict(references[family, 1]["params"], strict=False)  # the unsplit model after the steps
        theirs, ours = exported(input_ids=ids).logits, trained(input_ids=ids).logits
    torch.testing.assert_close(theirs, ours, rtol=RTOL, atol=ATOL)
    assert (theirs - before).abs().max() > 100 * ATOL, "the steps did not change the model"
    blocks = build_sequential(HFCausalLM.from_folder(out, seq_len=SEQ), seed=0).eval()  # pipetrain reads it back
    with torch.no_grad():  # Granite's multiplier and divisor, Gemma 2's cap...: the same logits as transformers'
        torch.testing.assert_close(blocks(ids), theirs, rtol=RTOL, atol=ATOL)


@pytest.fixture(scope="module")
def checks(runs, tmp_path_factory):
    """`pipetrain check --workload hf --model DIR --data synthetic --batch-size 4 --seq-len 32 --steps 2 --pp 2
    --schedule 1f1b --chunks 2` for every family: all in one job of 2 ranks (what the command runs, `run_checks`)."""
    _, _, folders, root = runs
    folders = {**folders, "arcee (generic)": str(_arcee_folder(root / "arcee"))}
    pipeline = PipelineConfig(pp=2, schedule="1f1b", n_microbatches=2)
    configs = {family: TrainConfig(parallel=ParallelConfig(pipeline=pipeline), workload="hf",
                                   model_dir=Path(folder), data="synthetic", batch_size=4, seq_len=32,
                                   train_samples=8, test_samples=4, epochs=1, progress=False)
               for family, folder in folders.items()}
    jobs = [(config, load_data(config)[0]) for config in configs.values()]
    return dict(zip(configs, run_checks(jobs, steps=2, work_dir=tmp_path_factory.mktemp("check"))))


def _arcee_folder(folder: Path) -> Path:
    """A tiny Arcee (no description of its own, the common layout: the generic description) with the tokenizer."""
    tokenizer = tiny_tokenizer()
    sizes = {k: v for k, v in family_configs()["mistral"].to_dict().items()
             if k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "max_position_embeddings", "pad_token_id")}
    torch.manual_seed(SEED)
    config = transformers.ArceeConfig(**sizes, vocab_size=len(tokenizer))
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("family", sorted(family_configs()) + ["arcee (generic)"])
def test_pipetrain_check_passes_each_family(family, checks):
    report = checks[family]
    text = "\n".join(report.lines())
    assert report.passed and text.splitlines()[-1].startswith("PASS"), text
    worst = max(max(d.grad for d in step.blocks.values()) for step in report.steps)
    assert 0 < worst <= report.tolerances.grad  # compared for real: round-off shows, within tolerance

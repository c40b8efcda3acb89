"""Tied embeddings across stages: a tied tiny Llama and GPT-2, pipelined, equal the unsplit tied transformers model.

The input embedding (block 0, first stage) and the output head (last block, last stage) are one tensor in
the transformers model; in pipetrain each stage holds a copy whose gradients the engine sums over the two
stages after every backward (`pipetrain.pipeline.tied`). One spawned job of 4 ranks runs, per family: pp=2
(two pipelines of 2 ranks, 1F1B), pp=4 (1F1B), dp=2 x pp=2 (GPipe with FSDP2: the copies' shards are summed;
DDP's averaged gradients are summed the same way, after DDP, as test_hf_parity's DDP layouts run). Over three SGD
steps (a full batch, a short right-padded one, one smaller than 4 micro-batches): the losses, the gradients
(the head's copy against the tied tensor's gradient, which sums both uses) and the final parameters equal
the unsplit model's within the fp32 parity tolerance (rtol 1e-5, atol 4e-5); both copies end equal. The same
job checks that the global gradient norm counts the tied weight once (against `get_total_norm` of the unsplit
model's parameters), that the recipe's parameter groups give the head's copy no weight decay (as the embedding),
and that a checkpoint written at dp=2 x pp=2 stores the tied weight once and exports it to both blocks.
Round trip through Hugging Face: the Llama folder (with a tokenizer of its own) trained at pp=2 is checkpointed,
exported with `pipetrain export CKPT OUT --hf`, reloaded with `AutoModelForCausalLM.from_pretrained` (tied) and
`AutoTokenizer.from_pretrained`: its logits equal the unsplit model's after the same steps (rtol 1e-5, atol
4e-5) and differ from the folder's before them. The spawned job is test_hf_parity's (one start-up for both).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from pipetrain.checkpoint import export_checkpoint  # noqa: E402
from pipetrain.cli import main as cli_main  # noqa: E402
from pipetrain.checkpoint.state import save_checkpoint  # noqa: E402
from pipetrain.config import ParallelConfig, PipelineConfig  # noqa: E402
from pipetrain.launch.env import free_port  # noqa: E402
from pipetrain.launch.spawn import RankSpec, spawn  # noqa: E402
from pipetrain.pipeline import PipelineEngine  # noqa: E402
from pipetrain.recipe.clip import grad_norm  # noqa: E402
from pipetrain.recipe.groups import no_decay_names  # noqa: E402
from pipetrain.session import build_session, close_session, join_job  # noqa: E402
from pipetrain.workloads.hf.causal_lm import HFCausalLM, causal_lm_loss  # noqa: E402
from tests.distributed.test_hf_parity import (ATOL, LR, RTOL, SEED, SEQ, VOCAB, _full, make_batches,  # noqa: E402
                                             reference, spawned)
from tests.hf_folders import tiny_tokenizer, transformers_names  # noqa: E402

#: case -> (dp, dp mode, pp, schedule); "pp2" runs two independent pipelines of 2 ranks (dp=1 each)
LAYOUTS = {
    "pp2-1f1b": (1, "ddp", 2, "1f1b"),
    "pp2-zbv": (1, "ddp", 2, "zbv"),  # V placement: the embedding (stage 0) and the head (stage 3) share rank 0
    "pp4-1f1b": (1, "ddp", 4, "1f1b"),
    "dp2xpp2-gpipe-fsdp": (2, "fsdp", 2, "gpipe"),
}
EMBEDDING = {"llama": "model.embed_tokens.weight", "gpt2": "transformer.wte.weight"}
CHECKPOINTED = {"dp2xpp2-gpipe-fsdp": "ckpt", "pp2-1f1b": "ckpt-pp2"}


def tied_configs() -> dict:
    return {
        "llama": transformers.LlamaConfig(vocab_size=len(tiny_tokenizer()), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                          tie_word_embeddings=True),
        "gpt2": transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                        tie_word_embeddings=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                        bos_token_id=0, eos_token_id=0),
    }


def _engine(model: HFCausalLM, layout: str, device: torch.device, pairs: list) -> tuple[PipelineEngine, int]:
    dp, dp_mode, pp, schedule = LAYOUTS[layout]
    pipeline = PipelineConfig(pp=pp, schedule=schedule, n_microbatches=4)
    if layout.startswith("pp2"):
        group = pairs[dist.get_rank() // 2]
        return PipelineEngine(model, pipeline, device=device, pp_group=group, loss_fn=causal_lm_loss, seed=SEED,
                              metrics_group=group), 0
    session = build_session(model, ParallelConfig(dp=dp, dp_mode=dp_mode, pipeline=pipeline), device, seed=SEED,
                            loss_fn=causal_lm_loss)
    return session.engine, session.mesh.dp_rank


def _train(folder: str, family: str, layout: str, device: torch.device, pairs: list, save: Path) -> dict:
    dp = LAYOUTS[layout][0]
    model = HFCausalLM.from_folder(folder, seq_len=SEQ)
    engine, replica = _engine(model, layout, device, pairs)
    keys = transformers_names(model)
    keys = {name: EMBEDDING[family] if hf == "lm_head.weight" else hf for name, hf in keys.items()}
    opt = torch.optim.SGD(engine.parameters(), lr=LR)
    losses, grads, norms = [], [], []
    for x, labels in make_batches(dp):
        share = slice(replica * x.shape[0] // dp, (replica + 1) * x.shape[0] // dp)
        opt.zero_grad()
        losses.append(engine.step(x[share], labels[share]).loss)
        norms.append(grad_norm(engine))
        grads.append([(keys[n], _full(p.grad).clone()) for n, p in engine.named_parameters()])
        opt.step()
    params = [(keys[n], _full(p.detach()).clone()) for n, p in engine.named_parameters()]
    if layout in CHECKPOINTED:
        save_checkpoint(save / CHECKPOINTED[layout] / family, engine, opt, step=3)
    return {"losses": losses, "grads": grads, "params": params, "norms": norms,
            "no_decay": sorted(no_decay_names(engine)), "names": [n for n, _ in engine.named_parameters()]}


def tied_records(folders: dict[str, str], device: torch.device, out: Path) -> dict:
    """This rank's records of every tied case (called by test_hf_parity's worker, in its job)."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return {f"tied-{family}-{layout}": _train(folder, family, layout, device, pairs, out)
            for family, folder in folders.items() for layout in LAYOUTS}


def tied_setup(root: Path) -> tuple[dict, dict]:
    """The tied folders (the Llama one with a tokenizer) and their single-process references."""
    folders, references = {}, {}
    for family, config in tied_configs().items():
        torch.manual_seed(SEED)
        model = transformers.AutoModelForCausalLM.from_config(config)
        assert model.lm_head.weight is model.get_input_embeddings().weight  # the reference is tied
        folders[family] = str(root / f"tied-{family}")
        model.save_pretrained(folders[family])
        if family == "llama":
            tiny_tokenizer().save_pretrained(folders[family])
        initial = {n: p.detach().clone() for n, p in model.state_dict().items()}
        for dp in (1, 2):
            model.load_state_dict(initial)
            ref = reference(model, dp)
            model.load_state_dict(initial)
            ref["norm0"] = _first_norm(model, dp)
            references[family, dp] = ref
    return folders, references


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    job = spawned(tmp_path_factory)
    return job["per_rank"], job["tied_references"], job["root"], job["tied_folders"]


def _first_norm(model: torch.nn.Module, dp: int) -> float:
    x, labels = make_batches(dp)[0]
    model.zero_grad()
    model(input_ids=x, labels=labels).loss.backward()
    return torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tied_pipelined_model_matches_unsplit_tied_model(family, layout, runs):
    per_rank, references, _, _ = runs
    ref = references[family, LAYOUTS[layout][0]]
    seen, tied_copies = set(), []
    for records in per_rank:
        record = records[f"tied-{family}-{layout}"]
        torch.testing.assert_close(torch.tensor(record["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=ATOL)
        # the tied weight counts once in the global norm (the unsplit model has it once)
        assert record["norms"][0] == pytest.approx(ref["norm0"], rel=1e-5)
        for step, grads in enumerate(record["grads"]):
            for name, grad in grads:
                torch.testing.assert_close(grad, ref["grads"][step][name], rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"step {step} gradient of {name}: {m}")
        for name, value in record["params"]:
            torch.testing.assert_close(value, ref["params"][name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
            seen.add(name)
            if name == EMBEDDING[family]:
                tied_copies.append(value)
        heads = [n for n in record["names"] if n.endswith("lm_head.weight")]
        assert set(heads) <= set(record["no_decay"]), "the head's copy of the embedding must get no weight decay"
    assert seen == set(ref["params"]), f"parameters held by no rank: {sorted(set(ref['params']) - seen)}"
    assert len(tied_copies) >= 2  # the embedding's and the head's copies, both equal to the tied tensor
    moved = max((ref["params"][n] - ref["initial"][n]).abs().max().item() for n in ref["params"])
    assert moved > 100 * ATOL, f"the reference's parameters barely moved ({moved})"


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_checkpoint_stores_a_tied_weight_once(family, runs):
    per_rank, references, root, folders = runs
    folder = next((root / "ckpt" / family).glob("step-*"))
    keys = set(dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata)
    model = HFCausalLM.from_folder(folders[family], seq_len=SEQ)
    head, embedding = f"{model.num_blocks - 1}.lm_head.weight", "0." + EMBEDDING[family].rpartition(".")[0].rpartition(".")[2] + ".weight"
    assert f"model.{embedding}" in keys
    assert not any("lm_head" in k for k in keys), "the head's copy is stored (model or optimizer state)"
    weights = export_checkpoint(folder, model, root / f"{family}.pt")
    final = references[family, 2]["params"][EMBEDDING[family]]
    for name in (embedding, head):
        torch.testing.assert_close(weights[name], final, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def test_export_hf_round_trip_reloads_the_trained_tied_model(runs, tmp_path, capsys):
    _, references, root, folders = runs
    out = tmp_path / "exported"
    code = cli_main.main(["export", str(root / "ckpt-pp2" / "llama"), str(out), "--hf", "--workload", "hf",
                          "--preset", "llama-tiny", "--model", folders["llama"]])
    assert code == 0, capsys.readouterr()
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert exported.lm_head.weight is exported.get_input_embeddings().weight  # written tied, loaded tied
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer("The cat sat")["input_ids"] == tiny_tokenizer()("The cat sat")["input_ids"]
    trained = transformers.AutoModelForCausalLM.from_pretrained(folders["llama"]).eval()
    before = trained(input_ids=make_batches()[0][0]).logits.detach()
    trained.load_state_dict(references["llama", 1]["params"], strict=False)  # the unsplit model after the steps
    ids = make_batches()[0][0]
    with torch.no_grad():
        theirs, ours = exported(input_ids=ids).logits, trained(input_ids=ids).logits
    torch.testing.assert_close(theirs, ours, rtol=RTOL, atol=ATOL)
    assert (theirs - before).abs().max() > 100 * ATOL, "the steps did not change the model"

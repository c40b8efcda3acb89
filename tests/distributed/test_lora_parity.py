"""LoRA through PEFT on every layout equals an unsplit PEFT model: a tiny Llama and a tiny GPT-2 (tied head).

The reference is `peft.get_peft_model` on the transformers model of the folder, with the same `LoraConfig` (rank 4,
alpha 8, the family's attention and MLP projections) and the same initial adapters: PEFT's layers built with
`init_lora_weights=False` (B not zero, so A's gradients are not zero from the first step), block by block under
pipetrain's block seeds, copied into the reference. One spawned job of 4 ranks runs, per model: pp2 1F1B (ranks 0-1)
beside pp2 interleaved 1F1B (ranks 2-3, two virtual stages each), pp4 1F1B with recomputation (`always`; its first
stage holds the frozen embedding alone, its last the frozen head alone), dp2 × pp2 1F1B with DDP and with FSDP2,
and pp2 × tp2 1F1B. Over three SGD steps with momentum (the optimizer from pipetrain's parameter groups): the loss on
every rank, every adapter gradient at every step and every final adapter equal the reference's within rtol 1e-5,
atol 4e-5; every base weight is bitwise the folder's after the steps; the optimizer holds a state for the adapters
only, and the frozen base has no gradient. The pp4 run saves a checkpoint (adapters and momenta only, plus the base
folder's identity; its frozen first and last ranks have empty optimizers), which the same job loads under dp2 x pp2
(DDP) bit for bit; `pipetrain export --peft` of it loads with `PeftModel.from_pretrained(base, OUT)` and `--hf
--merge` with `AutoModelForCausalLM.from_pretrained(OUT)`, both giving the pipeline's logits (same tolerance); the
adapters are refused on a base folder of other weights.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from pipetrain.blocks import build_sequential  # noqa: E402
from pipetrain.checkpoint.state import find_checkpoint, load_checkpoint, save_checkpoint  # noqa: E402
from pipetrain.checkpoint.export import read_weights  # noqa: E402
from pipetrain.checkpoint.folders import read_meta  # noqa: E402
from pipetrain.cli import main as cli_main  # noqa: E402
from pipetrain.errors import ConfigError  # noqa: E402
from pipetrain.launch.env import free_port  # noqa: E402
from pipetrain.launch.spawn import RankSpec, spawn  # noqa: E402
from pipetrain.lora import LoraBlocks, LoraSettings  # noqa: E402
from pipetrain.pipeline import PipelineEngine  # noqa: E402
from pipetrain.recipe import param_groups  # noqa: E402
from pipetrain.session import close_session, join_job  # noqa: E402
from pipetrain.workloads.hf.causal_lm import HFCausalLM  # noqa: E402
from tests.distributed.test_hf_parity import (ATOL, RTOL, SEED, SEQ, compare_records, layout_engine,  # noqa: E402
                                              make_batches, tiny_configs)
from tests.hf_folders import tiny_tokenizer, transformers_names  # noqa: E402

LR, MOMENTUM = 0.2, 0.9
SETTINGS = LoraSettings(rank=4, init=False)
PEFT_PREFIX = "base_model.model."
#: the layout whose checkpoint is saved (first and last stages frozen: their optimizers are empty), then loaded
#: under dp2 x pp2 DDP and exported
SAVED = "pp4-1f1b-recompute"
#: case -> (dp, dp mode, pp, tp, schedule, stages per rank, recomputation); "pp2" cases run on two pairs of ranks
LAYOUTS = {
    "pp2-1f1b": (1, "ddp", 2, 1, "1f1b", None, "never"),
    "pp2-interleaved": (1, "ddp", 2, 1, "interleaved-1f1b", 2, "never"),
    "pp4-1f1b-recompute": (1, "ddp", 4, 1, "1f1b", None, "always"),
    "dp2xpp2-ddp": (2, "ddp", 2, 1, "1f1b", None, "never"),
    "dp2xpp2-fsdp": (2, "fsdp", 2, 1, "1f1b", None, "never"),
    "pp2xtp2": (1, "ddp", 2, 2, "1f1b", None, "never"),
}


def lora_configs() -> dict:
    """test_hf_parity's tiny models with the tiny tokenizer's vocabulary (its folders are `--model DIR` folders),
    GPT-2 with its head tied to the embedding (frozen on two stages)."""
    configs = tiny_configs()
    configs["gpt2"].tie_word_embeddings = True
    for config in configs.values():
        config.vocab_size = len(tiny_tokenizer())
    return configs


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _model(folder: str) -> LoraBlocks:
    return LoraBlocks(HFCausalLM.from_folder(folder, seq_len=SEQ), SETTINGS)


def _engine(model: LoraBlocks, layout: str, device: torch.device, pairs: list) -> tuple[PipelineEngine, int]:
    return layout_engine(model, LAYOUTS[layout], device, pairs)


def _train(folder: str, layout: str, device: torch.device, pairs: list, save: Path | None = None) -> dict:
    dp = LAYOUTS[layout][0]
    model = _model(folder)
    engine, replica = _engine(model, layout, device, pairs)
    keys = transformers_names(model)
    base = {n: _full(p.detach()).clone() for n, p in engine.named_parameters() if not p.requires_grad}
    opt = torch.optim.SGD(param_groups(engine, 0.0), lr=LR, momentum=MOMENTUM)
    losses, grads = [], []
    for x, labels in make_batches(dp):
        share = slice(replica * x.shape[0] // dp, (replica + 1) * x.shape[0] // dp)
        opt.zero_grad()
        losses.append(engine.step(x[share], labels[share]).loss)
        grads.append([(keys[n], _full(p.grad).clone()) for n, p in engine.named_parameters() if p.requires_grad])
        opt.step()
    named = dict(engine.named_parameters())
    extra = {}
    if save is not None:  # a checkpoint of the adapters, the pipeline's logits of the first batch, the momenta
        save_checkpoint(save, engine, opt, step=len(losses), config={"lora": dataclasses.asdict(SETTINGS)})
        logits = engine.evaluate(make_batches()[0][0], make_batches()[0][1]).outputs
        extra = {"logits": None if logits is None else logits.clone(), "momenta": _momenta(engine, opt, keys)}
    return {"losses": losses, "grads": grads, **extra,
            "params": [(keys[n], _full(p.detach()).clone()) for n, p in named.items() if p.requires_grad],
            "base_moved": max([(_full(named[n].detach()) - value).abs().max().item() for n, value in base.items()]
                              + [0.0]),
            "base_grads": [keys[n] for n, p in named.items() if not p.requires_grad and p.grad is not None],
            "optimizer_state": sorted(keys[n] for n, p in named.items() if p in opt.state),
            "trainable": sorted(keys[n] for n, p in named.items() if p.requires_grad),
            "frozen": len(base),
            "split": {keys[n]: tuple(p.to_local().shape) for n, p in named.items() if isinstance(p, DTensor)}}


def _momenta(engine: PipelineEngine, opt: torch.optim.Optimizer, keys: dict[str, str]) -> dict[str, torch.Tensor]:
    return {keys[n]: _full(opt.state[p]["momentum_buffer"]).clone() for n, p in engine.named_parameters()
            if p in opt.state}


def _resumed(folder: str, save: Path, device: torch.device) -> dict:
    """The pp4 checkpoint loaded under dp2 x pp2 (DDP, 1F1B): its adapters and momenta on this layout."""
    model = _model(folder)
    engine, _ = _engine(model, "dp2xpp2-ddp", device, [])
    keys = transformers_names(model)
    opt = torch.optim.SGD(param_groups(engine, 0.0), lr=LR, momentum=MOMENTUM)
    load_checkpoint(save, engine, opt)
    return {"params": {keys[n]: _full(p.detach()).clone() for n, p in engine.named_parameters() if p.requires_grad},
            "momenta": _momenta(engine, opt, keys)}


def _worker(spec: RankSpec, folders: dict[str, str], out: str) -> None:
    device = join_job(spec)
    try:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        records = {}
        for family, folder in folders.items():
            pp2 = "pp2-1f1b" if spec.rank < 2 else "pp2-interleaved"  # the two pairs at once
            records[f"{family}-{pp2}"] = _train(folder, pp2, device, pairs)
            for layout in [name for name in LAYOUTS if not name.startswith("pp2-")]:
                save = Path(out) / "ckpt" / family if layout == SAVED else None
                records[f"{family}-{layout}"] = _train(folder, layout, device, pairs, save)
            records[f"{family}-resumed"] = _resumed(folder, Path(out) / "ckpt" / family, device)
        torch.save(records, Path(out) / f"rank{spec.rank}.pt")
    finally:
        close_session()


def initial_adapters(folder: str) -> dict[str, torch.Tensor]:
    """The adapters every rank starts from (PEFT's layers under pipetrain's block seeds), by PEFT model name."""
    model = _model(folder)
    keys = transformers_names(model)
    net = build_sequential(model, seed=SEED)
    return {PEFT_PREFIX + keys[n]: p.detach().clone() for n, p in net.named_parameters() if p.requires_grad}


def peft_reference(folder: str, dp: int) -> dict:
    """`get_peft_model` on the transformers model of `folder`, started from `initial_adapters`, three SGD steps."""
    base = transformers.AutoModelForCausalLM.from_pretrained(folder)
    targets = list(HFCausalLM.from_folder(folder, seq_len=SEQ).lora_targets())
    model = peft.get_peft_model(base, SETTINGS.peft_config(tuple(targets)))
    initial = initial_adapters(folder)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert set(trainable) == set(initial), sorted(set(trainable) ^ set(initial))
    with torch.no_grad():
        for name, param in trainable.items():
            param.copy_(initial[name])
    opt = torch.optim.SGD(trainable.values(), lr=LR, momentum=MOMENTUM)
    losses, grads = [], []
    for x, labels in make_batches(dp):
        opt.zero_grad()
        loss = model(input_ids=x, labels=labels).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({n.removeprefix(PEFT_PREFIX): p.grad.clone() for n, p in trainable.items()})
        opt.step()
    return {"losses": losses, "grads": grads, "initial": {n.removeprefix(PEFT_PREFIX): v for n, v in initial.items()},
            "params": {n.removeprefix(PEFT_PREFIX): p.detach().clone() for n, p in trainable.items()}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    folders, references = {}, {}
    for family, config in lora_configs().items():
        torch.manual_seed(SEED)
        folders[family] = str(root / family)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folders[family])
        tiny_tokenizer().save_pretrained(folders[family])
        for dp in (1, 2):
            references[family, dp] = peft_reference(folders[family], dp)
    spawn(_worker, ranks=range(4), world_size=4, master_addr="127.0.0.1", master_port=free_port(),
          args=(folders, str(root)), timeout_s=600)
    return [torch.load(root / f"rank{r}.pt") for r in range(4)], references, folders, root


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_lora_on_every_layout_equals_the_unsplit_peft_model(family, layout, runs):
    per_rank, references, _, _ = runs
    ref = references[family, LAYOUTS[layout][0]]
    records = [r[f"{family}-{layout}"] for r in per_rank if f"{family}-{layout}" in r]
    assert len(records) == (2 if layout.startswith("pp2-") else 4)
    seen = compare_records(records, ref)
    for record in records:
        assert record["base_moved"] == 0.0, f"a frozen base weight changed by {record['base_moved']}"
        assert record["frozen"] > 0 or not record["trainable"]
        assert record["base_grads"] == [], f"frozen parameters with a gradient: {record['base_grads']}"
        assert record["optimizer_state"] == record["trainable"], "the optimizer holds state beyond the adapters"
        assert all(".lora_A." in n or ".lora_B." in n for n in record["trainable"])
    assert seen == set(ref["params"]), f"adapters held by no rank: {sorted(set(ref['params']) - seen)}"
    if layout == "pp2xtp2":  # the adapters follow the base's split: B by rows under a column-parallel base, A by
        split = {n: s for r in records for n, s in r["split"].items()}  # columns under a row-parallel one
        layer = "model.layers.0" if family == "llama" else "transformer.h.0"
        expect = ({f"{layer}.self_attn.q_proj.lora_B.default.weight": (16, 4),
                   f"{layer}.self_attn.o_proj.lora_A.default.weight": (4, 16),
                   f"{layer}.mlp.down_proj.lora_A.default.weight": (4, 32)} if family == "llama" else
                  {f"{layer}.attn.c_attn.lora_B.default.weight": (48, 4),
                   f"{layer}.attn.c_proj.lora_A.default.weight": (4, 16),
                   f"{layer}.mlp.c_fc.lora_B.default.weight": (64, 4)})
        assert {n: split.get(n) for n in expect} == expect, split
        assert not any(".lora_A." in n and ("q_proj" in n or "c_attn" in n) for n in split), "A of a colwise base split"
    first_a = [n for n in ref["grads"][0] if ".lora_A." in n]
    assert first_a and all(ref["grads"][0][n].abs().max() > 0 for n in first_a), "A's first gradients are zero"
    moved = max((ref["params"][n] - ref["initial"][n]).abs().max().item() for n in ref["params"])
    assert moved > 100 * ATOL, f"the reference's adapters barely moved ({moved})"


def _saved(per_rank: list[dict], family: str, what: str) -> dict:
    return {name: value for records in per_rank for name, value in records[f"{family}-{SAVED}"][what].items()}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_the_checkpoint_holds_the_adapters_their_momenta_and_the_base_identity(family, runs):
    per_rank, references, folders, root = runs
    folder = root / "ckpt" / family / "step-00000003"
    keys = set(dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata)
    model_keys = {k for k in keys if k.startswith("model.")}
    adapters = {f"model.{n}" for n in transformers_names(_model(folders[family])) if ".lora_" in n}
    assert model_keys == adapters, sorted(model_keys ^ adapters)[:4]
    optimizer = {k.split(".", 2)[2].rpartition(".")[0] for k in keys if k.startswith("optim.state.")}
    assert optimizer == {k[len("model."):] for k in adapters}
    base = read_meta(folder).extras["base"]
    assert base["folder"] == str(Path(folders[family]).resolve()) and len(base["digest"]) == 64
    assert "model.safetensors" in base["files"] and "config.json" in base["files"]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_the_checkpoint_resumes_under_another_layout(family, runs):
    per_rank, _, _, _ = runs
    saved = {n: v for records in per_rank for n, v in records[f"{family}-{SAVED}"]["params"]}
    momenta = _saved(per_rank, family, "momenta")
    assert set(momenta) == set(saved)  # pp4's ranks 1 and 2: every adapter's momentum (ranks 0 and 3 have none)
    for records in per_rank:  # every rank of dp2 x pp2 holds its stage's adapters and momenta, bit for bit
        resumed = records[f"{family}-resumed"]
        assert resumed["params"] and set(resumed["params"]) == set(resumed["momenta"])
        for name, value in resumed["params"].items():
            assert torch.equal(value, saved[name]), name
            assert torch.equal(resumed["momenta"][name], momenta[name]), name


def _pipeline_logits(per_rank: list[dict], family: str) -> torch.Tensor:
    return next(r[f"{family}-{SAVED}"]["logits"] for r in per_rank if r[f"{family}-{SAVED}"]["logits"] is not None)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_peft_export_loads_in_peft_with_the_pipeline_logits(family, runs, tmp_path, capsys):
    per_rank, _, folders, root = runs
    out = tmp_path / "adapter"
    code = cli_main.main(["export", str(root / "ckpt" / family), str(out), "--peft", "--workload", "hf",
                          "--preset", "llama-tiny", "--model", folders[family]])
    assert code == 0, capsys.readouterr()
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in out.iterdir()}
    base = transformers.AutoModelForCausalLM.from_pretrained(folders[family])
    loaded = peft.PeftModel.from_pretrained(base, out).eval()
    with torch.no_grad():
        logits = loaded(input_ids=make_batches()[0][0]).logits
    torch.testing.assert_close(logits, _pipeline_logits(per_rank, family), rtol=RTOL, atol=ATOL)
    plain = transformers.AutoModelForCausalLM.from_pretrained(folders[family]).eval()
    with torch.no_grad():
        assert (plain(input_ids=make_batches()[0][0]).logits - logits).abs().max() > 100 * ATOL


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_merged_export_is_a_transformers_folder_with_the_pipeline_logits(family, runs, tmp_path, capsys):
    per_rank, _, folders, root = runs
    out = tmp_path / "merged"
    code = cli_main.main(["export", str(root / "ckpt" / family), str(out), "--hf", "--merge", "--workload", "hf",
                          "--preset", "llama-tiny", "--model", folders[family]])
    assert code == 0, capsys.readouterr()
    merged = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert not any("lora" in name for name in merged.state_dict())
    with torch.no_grad():
        logits = merged(input_ids=make_batches()[0][0]).logits
    torch.testing.assert_close(logits, _pipeline_logits(per_rank, family), rtol=RTOL, atol=ATOL)


def test_adapters_of_another_base_folder_are_refused(runs, tmp_path):
    _, _, folders, root = runs
    torch.manual_seed(SEED + 1)  # the same architecture, other weights
    transformers.AutoModelForCausalLM.from_config(lora_configs()["llama"]).save_pretrained(tmp_path / "other")
    with pytest.raises(ConfigError, match=r"holds LoRA adapters of the base model .*llama.* this job's base is "
                                          r".*other.*: its config or weights differ") as err:
        read_weights(root / "ckpt" / "llama", _model(str(tmp_path / "other")))
    assert "--model" in err.value.hint and folders["llama"] in err.value.hint


def test_resuming_lora_on_another_base_folder_is_one_message(runs, tmp_path, capsys):
    _, _, folders, root = runs
    other = tmp_path / "other"
    torch.manual_seed(SEED + 1)
    transformers.AutoModelForCausalLM.from_config(lora_configs()["llama"]).save_pretrained(other)
    tiny_tokenizer().save_pretrained(other)
    code = cli_main.main(["train", "--workload", "hf", "--model", str(other), "--lora-rank", "4", "--data", "synthetic",
                          "--seq-len", str(SEQ), "--pp", "2", "--save-dir", str(root / "ckpt" / "llama"), "--resume",
                          "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and err.count("error:") == 1, err
    assert f"holds LoRA adapters of the base model {Path(folders['llama']).resolve()}" in err
    assert f"pass --model {Path(folders['llama']).resolve()}" in err


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_generate_from_the_adapter_checkpoint_equals_peft_s_generate(family, runs, tmp_path, capsys):
    """`pipetrain generate --checkpoint` of adapters: the base from its folder, PEFT's layers on, the adapters read
    from the checkpoint; greedy tokens equal PEFT's `generate` over the exported adapter folder."""
    from pipetrain.generate.job import GenerateJob, build_stage, generate_batch, prepare_job
    from pipetrain.generate.loop import Placement
    from pipetrain.generate.weights import ModelSource

    _, _, folders, root = runs
    out = tmp_path / "adapter"
    assert cli_main.main(["export", str(root / "ckpt" / family), str(out), "--peft", "--workload", "hf",
                          "--preset", "llama-tiny", "--model", folders[family]]) == 0, capsys.readouterr()
    source = ModelSource(Path(folders[family]), find_checkpoint(root / "ckpt" / family), dataclasses.asdict(SETTINGS))
    job = GenerateJob(source, ("The cat", "It was the best of times"), pp=1, max_new_tokens=6)
    model, batch = prepare_job(job)
    stage = build_stage(model, Placement(0, 1), torch.device("cpu"), checkpoint=source.checkpoint)
    tokens = generate_batch(job, stage, Placement(0, 1), batch, model).tokens
    base = transformers.AutoModelForCausalLM.from_pretrained(folders[family])
    loaded = peft.PeftModel.from_pretrained(base, out).eval()
    with torch.no_grad():
        want = loaded.generate(input_ids=batch.ids, attention_mask=batch.mask, max_new_tokens=6, do_sample=False,
                               pad_token_id=0)[:, batch.ids.shape[1]:]
    assert tokens.shape == want.shape and torch.equal(tokens, want), (tokens, want)

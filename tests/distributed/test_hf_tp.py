"""Tensor parallelism on the Hugging Face blocks: a tiny Llama (GQA: 4 query heads, 2 key/value heads) and a tiny
GPT-2 (fused `Conv1D` c_attn) split over tp=2 equal the unsplit transformers model.

The cases run in test_hf_parity's spawned job of 4 ranks (one start-up for the three HF test files), on its
untied folders: pp2 × tp2 under 1F1B (Llama, GPT-2) and dp2 × tp2 with FSDP2 (GPT-2: its strided c_attn under
FSDP2). Over test_hf_parity's three SGD steps (a full batch, a short right-padded one, one smaller than the 4
micro-batches): the loss on every rank, every gradient at every step and every final parameter equal
`model(input_ids, labels=labels).loss`'s within the fp32 parity tolerance (rtol 1e-5, atol 4e-5), and the
decoder's projections are really split (local halves of DTensors). tp2 alone (2 ranks) is checked by
`pipetrain check --tp 2` in test_check.py's 2-rank job. Checkpoints: the Llama pp2 × tp2 run saves after step 2;
the same job resumes it at pp4 (tp 1) and its third step gives the uninterrupted loss and final parameters
(same tolerance); `export_hf` (what `pipetrain export --hf` runs) of that checkpoint is a folder transformers loads whose logits equal
the unsplit model's after the same two steps. Without processes: the refusals (tp not dividing the query heads,
the key/value heads or the MLP; sequence parallelism).

The vocabulary-parallel head (`--loss-parallel`, `VOCAB_CASES`), in the same job: the untied Llama at pp2 × tp2
(1F1B), the tied Llama at pp2 × tp2 (the embedding on the first stage, the head on the last, both split on the
vocabulary alike, their copies summed shard by shard) and the tied GPT-2 at dp2 × tp2 with FSDP2 (both copies on one
rank, FSDP2 on top of the vocabulary shards); sequence parallelism (`--sequence-parallel`): the untied Llama at
pp2 × tp2 with the vocabulary-parallel head (sequence shards cross the stage boundary) and the tied Llama at
dp2 × tp2 with FSDP2 (its norms' replicated weights under FSDP2): the same three steps against the unsplit (tied or untied) transformers
model, the same tolerance (rtol 1e-5, atol 4e-5); the embedding's and the head's matrices are really split (local
halves), and `CausalLMLoss.correct` of vocabulary-sharded logits (ties across the shards included) equals it on the
whole logits; under sequence parallelism the norms' weights are DTensors (they run on the shards). Without
processes: the refusals (test_hf_loss_parallel.py).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from torch.distributed.tensor import DTensor, Shard, distribute_tensor  # noqa: E402

from pipetrain.checkpoint.state import load_checkpoint, save_checkpoint  # noqa: E402
from pipetrain.workloads.hf.export import export_hf  # noqa: E402
from pipetrain.config import ParallelConfig, PipelineConfig  # noqa: E402
from pipetrain.errors import ConfigError  # noqa: E402
from pipetrain.parallel.tensor import check_tensor_parallel  # noqa: E402
from pipetrain.session import build_session  # noqa: E402
from pipetrain.workloads.hf.causal_lm import HFCausalLM, causal_lm_loss  # noqa: E402
from tests.hf_folders import transformers_names  # noqa: E402
from tests.distributed.test_hf_parity import (ATOL, LR, RTOL, SEED, SEQ, VOCAB, _full, compare_records,  # noqa: E402
                                             make_batches, sgd_steps, spawned, tiny_configs)
from tests.distributed.test_hf_tied import EMBEDDING  # noqa: E402

#: case -> (family, dp, pp, schedule, checkpoint folder to resume from or None)
CASES = {
    "llama-pp2xtp2-1f1b": ("llama", 1, 2, "1f1b", None),
    "gpt2-pp2xtp2-1f1b": ("gpt2", 1, 2, "1f1b", None),
    "gpt2-dp2xtp2-fsdp": ("gpt2", 2, 1, "gpipe", None),
    "llama-pp4<-pp2xtp2": ("llama", 1, 4, "1f1b", "llama-pp2xtp2-1f1b"),
}
SAVE_AT = 2
#: the vocabulary-parallel head (`--loss-parallel`) and sequence parallelism: case -> (folder: "untied" or "tied",
#: family, dp, pp, schedule, sequence-parallel, loss-parallel)
VOCAB_CASES = {
    "llama-pp2xtp2-1f1b-lp": ("untied", "llama", 1, 2, "1f1b", False, True),
    "tied-llama-pp2xtp2-1f1b-lp": ("tied", "llama", 1, 2, "1f1b", False, True),
    "tied-gpt2-dp2xtp2-fsdp-lp": ("tied", "gpt2", 2, 1, "gpipe", False, True),
    "llama-pp2xtp2-1f1b-sp-lp": ("untied", "llama", 1, 2, "1f1b", True, True),
    "tied-llama-dp2xtp2-fsdp-sp": ("tied", "llama", 2, 1, "gpipe", True, False),
}
#: a decoder projection of each family and its local shape at tp=2 (global: Llama q [32, 32], k [16, 32]; GPT-2
#: c_attn [32, 96] split by heads along dim 1, c_proj [32, 32] by rows)
SPLIT = {"llama": {"model.layers.0.self_attn.q_proj.weight": (16, 32), "model.layers.0.self_attn.k_proj.weight": (8, 32),
                   "model.layers.1.mlp.down_proj.weight": (32, 32)},
         "gpt2": {"transformer.h.0.attn.c_attn.weight": (32, 48), "transformer.h.1.mlp.c_proj.weight": (64, 32)}}


def _case(folder: str, name: str, device: torch.device, out: Path) -> dict:
    started = time.perf_counter()
    family, dp, pp, schedule, source = CASES[name]
    model = HFCausalLM.from_folder(folder, seq_len=SEQ)
    parallel = ParallelConfig(dp=dp, tp=1 if source else 2, dp_mode="fsdp",
                              pipeline=PipelineConfig(pp=pp, schedule=schedule, n_microbatches=4))
    session = build_session(model, parallel, device, seed=SEED, loss_fn=causal_lm_loss)
    engine, replica = session.engine, session.mesh.dp_rank
    keys = transformers_names(model)
    opt = torch.optim.SGD(engine.parameters(), lr=LR)
    first = load_checkpoint(out / "tp-ckpt" / source, engine, opt).extras["next_step"] if source else 0
    local = {keys[n]: tuple(p.to_local().shape) for n, p in engine.named_parameters() if isinstance(p, DTensor)}
    losses, grads = [], []
    for step, (x, labels) in enumerate(make_batches(dp)[first:], start=first):
        share = slice(replica * x.shape[0] // dp, (replica + 1) * x.shape[0] // dp)
        opt.zero_grad()
        losses.append(engine.step(x[share], labels[share]).loss)
        grads.append({keys[n]: _full(p.grad).clone() for n, p in engine.named_parameters()})
        opt.step()
        if name == "llama-pp2xtp2-1f1b" and step + 1 == SAVE_AT:
            save_checkpoint(out / "tp-ckpt" / name, engine, opt, step=step + 1, extras={"next_step": step + 1})
    params = {keys[n]: _full(p.detach()).clone() for n, p in engine.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params, "local": local, "first": first,
            "seconds": time.perf_counter() - started}  # this case's share of the job (reported, not asserted)


def _vocab_case(folder: str, name: str, device: torch.device) -> dict:
    kind, family, dp, pp, schedule, sp, lp = VOCAB_CASES[name]
    model = HFCausalLM.from_folder(folder, seq_len=SEQ)
    parallel = ParallelConfig(dp=dp, tp=2, dp_mode="fsdp", sequence_parallel=sp, loss_parallel=lp,
                              pipeline=PipelineConfig(pp=pp, schedule=schedule, n_microbatches=4))
    session = build_session(model, parallel, device, seed=SEED, loss_fn=causal_lm_loss)
    engine, replica = session.engine, session.mesh.dp_rank
    keys = transformers_names(model)
    if kind == "tied":  # the head's copy is the tied tensor (the reference's embedding)
        keys = {n: EMBEDDING[family] if hf == "lm_head.weight" else hf for n, hf in keys.items()}
    local = {n: (tuple(p.to_local().shape), "tp" in (p.device_mesh.mesh_dim_names or ()))  # split over tp or not
             for n, p in engine.named_parameters() if isinstance(p, DTensor)}
    opt = torch.optim.SGD(engine.parameters(), lr=LR)
    losses, grads = sgd_steps(engine, opt, keys, replica, dp)
    params = [(keys[n], _full(p.detach()).clone()) for n, p in engine.named_parameters()]
    head = next((p for n, p in engine.named_parameters() if n.endswith("lm_head.weight")), None)
    correct = None
    if head is not None and lp:  # accuracy of vocabulary-sharded logits: the best token, ties across the shards included
        tp_mesh = session.mesh.tp_mesh
        logits = torch.randint(0, 4, (3, SEQ, VOCAB), generator=torch.Generator().manual_seed(2)).float()
        targets = logits.argmax(dim=-1)
        targets[0] = (targets[0] + 1) % VOCAB  # some wrong
        sharded = distribute_tensor(logits, tp_mesh, [Shard(-1)])
        correct = (causal_lm_loss.correct(sharded, targets).item(), causal_lm_loss.correct(logits, targets).item())
    return {"losses": losses, "grads": grads, "params": params, "local": local, "correct": correct}


def tp_records(folders: dict[str, str], device: torch.device, out: Path,
               tied_folders: dict[str, str] | None = None) -> dict:
    """This rank's records of every TP case (called by test_hf_parity's worker, in its job); with `tied_folders`,
    the vocabulary-parallel cases too."""
    records = {f"tp-{name}": _case(folders[family], name, device, out) for name, (family, *_) in CASES.items()}
    for name, (kind, family, *_) in VOCAB_CASES.items() if tied_folders else ():
        records[f"tp-{name}"] = _vocab_case((tied_folders if kind == "tied" else folders)[family], name, device)
    return records


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    job = spawned(tmp_path_factory)
    return job["per_rank"], job["references"], job["root"]


@pytest.mark.parametrize("name", list(CASES))
def test_tensor_parallel_transformers_model_matches_unsplit(name, runs):
    per_rank, references, _ = runs
    family, dp, _, _, source = CASES[name]
    ref = references[family, dp]
    seen = set()
    for records in per_rank:
        record = records[f"tp-{name}"]
        first = record["first"]
        assert first == (SAVE_AT if source else 0)
        torch.testing.assert_close(torch.tensor(record["losses"]), torch.tensor(ref["losses"][first:]),
                                   rtol=RTOL, atol=ATOL)
        for step, grads in enumerate(record["grads"], start=first):
            for key, grad in grads.items():
                torch.testing.assert_close(grad, ref["grads"][step][key], rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"step {step} gradient of {key}: {m}")
        for key, value in record["params"].items():
            torch.testing.assert_close(value, ref["params"][key], rtol=RTOL, atol=ATOL, msg=lambda m: f"{key}: {m}")
            seen.add(key)
        if source is None:  # the decoder's matrices are split, whatever FSDP2 does to them on top
            for key, shape in SPLIT[family].items():
                if key in record["local"] and dp == 1:
                    assert record["local"][key] == shape, key
            assert record["local"], "no parameter of this rank is a DTensor: the plan was not applied"
        else:
            assert not record["local"], "the resumed run is tp 1"
    assert seen == set(ref["params"]), f"parameters held by no rank: {sorted(set(ref['params']) - seen)}"
    held = {key for records in per_rank for key in records[f"tp-{name}"]["local"]}
    assert source or set(SPLIT[family]) <= held


@pytest.mark.parametrize("name", list(VOCAB_CASES))
def test_vocabulary_parallel_head_matches_unsplit(name, tmp_path_factory):
    job = spawned(tmp_path_factory)
    kind, family, dp, _, _, sp, lp = VOCAB_CASES[name]
    ref = (job["tied_references"] if kind == "tied" else job["references"])[family, dp]
    vocab = job["tied_vocab"][family] if kind == "tied" else VOCAB
    records = [per_rank[f"tp-{name}"] for per_rank in job["per_rank"]]
    seen, split, correct = compare_records(records, ref), {}, []
    for record in records:
        split.update(record["local"])
        correct += [record["correct"]] if record["correct"] is not None else []
    assert seen == set(ref["params"]), f"parameters held by no rank: {sorted(set(ref['params']) - seen)}"
    split = {key: shape for key, (shape, over_tp) in split.items() if over_tp}  # (FSDP2 makes every weight a DTensor)
    ends = {key: shape for key, shape in split.items() if key.endswith(("lm_head.weight", "embed_tokens.weight",
                                                                           "wte.weight"))}
    names = {key.rpartition(".")[0].rpartition(".")[2] for key in ends}
    assert names == ({"lm_head", "wte" if family == "gpt2" else "embed_tokens"} if lp else set()), split
    assert set(ends.values()) <= {(vocab // 2 // dp, 32)}, split  # the vocabulary's rows over tp (FSDP2: over dp too)
    assert sp == any("layernorm" in key for key in split), split  # the norms run on sequence shards
    assert not lp or (correct and all(sharded == whole > 0 for sharded, whole in correct)), correct


def test_export_hf_of_a_tp_checkpoint_is_the_unsplit_model(runs, tmp_path):
    _, _, root = runs
    folder, out = root / "llama", tmp_path / "exported"  # (`pipetrain export --hf`'s CLI: test_hf_tied)
    export_hf(root / "tp-ckpt" / "llama-pp2xtp2-1f1b", HFCausalLM.from_folder(folder, seq_len=SEQ), out)
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    trained = transformers.AutoModelForCausalLM.from_pretrained(folder)
    opt = torch.optim.SGD(trained.parameters(), lr=LR)
    for x, labels in make_batches()[:SAVE_AT]:  # the unsplit model after the checkpoint's two steps
        opt.zero_grad()
        trained(input_ids=x, labels=labels).loss.backward()
        opt.step()
    ids = make_batches()[0][0]
    with torch.no_grad():
        theirs, ours = exported(input_ids=ids).logits, trained.eval()(input_ids=ids).logits
        before = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()(input_ids=ids).logits
    torch.testing.assert_close(theirs, ours, rtol=RTOL, atol=ATOL)
    assert (theirs - before).abs().max() > 100 * ATOL, "the steps did not change the model"


def _model(family: str, **changes) -> HFCausalLM:
    config = tiny_configs()[family]
    for key, value in changes.items():
        setattr(config, key, value)
    return HFCausalLM(config, seq_len=SEQ)


@pytest.mark.parametrize(("family", "changes", "tp", "named"), [
    ("llama", {}, 4, "num_key_value_heads=2"),  # GQA: 4 query heads, 2 key/value heads
    ("llama", {"num_attention_heads": 2, "num_key_value_heads": 2}, 4, "num_attention_heads=2"),
    ("llama", {"intermediate_size": 66}, 4, "intermediate_size=66"),
    ("gpt2", {"n_head": 2}, 4, "n_head=2"),
    ("gpt2", {"n_inner": 66}, 4, "n_inner=66"),
])
def test_tp_not_dividing_the_heads_or_the_mlp_is_refused_naming_them(family, changes, tp, named):
    with pytest.raises(ConfigError) as err:
        check_tensor_parallel(_model(family, **changes), tp)
    text = str(err.value)
    assert named in text and f"tp={tp}" in text and "--tp among" in text, text


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_hf_plans_split_the_decoder_layers_only(family):
    model = _model(family)
    check_tensor_parallel(model, 2)
    plans = [model.tp_plan(i, 2) for i in range(model.num_blocks)]
    assert plans[0] is None and plans[-1] is None and all(plans[1:-1])
    if family == "gpt2":  # GPT-2 has no sequence-parallel plan (Llama's: test_hf_loss_parallel.py)
        with pytest.raises(ConfigError, match="sequence-parallel"):
            model.tp_plan(1, 2, sequence_parallel=True)

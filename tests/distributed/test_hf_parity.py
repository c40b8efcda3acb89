"""Hugging Face parity: a tiny Llama and a tiny GPT-2, pipelined, equal the unsplit transformers model.

Each reference model is built from its config under a fixed seed and saved as a safetensors folder; every
rank builds only its own blocks from that folder (`HFCausalLM.from_folder`). One spawned job of 4 ranks runs
pp=4 (1F1B) and dp=2 x pp=2 (GPipe with FSDP2, 1F1B with DDP), and, in the same job, test_hf_tied's and
test_hf_tp's cases. Over three SGD steps (a full batch, a short
right-padded one that 4 micro-batches do not divide, and one smaller than 4, per replica): the loss on every
rank, every gradient at every step and every final parameter equal the transformers model's
(`model(input_ids, labels=labels).loss`) within the fp32 tolerance of the other parity tests (rtol 1e-5,
atol 4e-5).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from pipetrain.config import ParallelConfig, PipelineConfig  # noqa: E402
from pipetrain.launch.env import free_port  # noqa: E402
from pipetrain.launch.spawn import RankSpec, spawn  # noqa: E402
from pipetrain.pipeline import PipelineEngine  # noqa: E402
from pipetrain.session import build_session, close_session, join_job  # noqa: E402
from pipetrain.workloads.hf.causal_lm import HFCausalLM, causal_lm_loss  # noqa: E402
from tests.hf_folders import transformers_names  # noqa: E402

RTOL, ATOL = 1e-5, 4e-5
SEED, LR, VOCAB, SEQ = 0, 0.5, 96, 16
SIZES = [8, 6, 3]  # per pipeline replica
#: case -> (dp, dp mode, pp, schedule)
LAYOUTS = {
    "pp4-1f1b": (1, "ddp", 4, "1f1b"),
    "dp2xpp2-gpipe-fsdp": (2, "fsdp", 2, "gpipe"),
    "dp2xpp2-1f1b-ddp": (2, "ddp", 2, "1f1b"),
}


def tiny_configs() -> dict:
    return {
        "llama": transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
        "gpt2": transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                        tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                        bos_token_id=0, eos_token_id=0),
    }


def make_batches(dp: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input ids, labels): sequences that follow a rule (each token is the previous one + 7). The second batch
    is right-padded to random lengths (padding labels -100), so micro-batches hold unequal token counts."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for index, n in enumerate(size * dp for size in SIZES):
        ids = (torch.randint(0, VOCAB, (n, 1), generator=gen) + 7 * torch.arange(SEQ)) % VOCAB
        labels = ids.clone()
        if index == 1:
            padding = torch.arange(SEQ)[None] >= torch.randint(3, SEQ + 1, (n, 1), generator=gen)
            ids[padding], labels[padding] = 0, -100
        out.append((ids, labels))
    return out


def reference(model: torch.nn.Module, dp: int) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    for x, labels in make_batches(dp):
        opt.zero_grad()
        loss = model(input_ids=x, labels=labels).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    final = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "params": final, "initial": initial}


def layout_engine(model, layout: tuple, device: torch.device, pairs: list) -> tuple:
    """(engine, replica) of `layout` = (dp, dp mode, pp, tp, schedule, stages per rank[, recomputation]) in a 4-rank
    job: a `pp2-` layout runs as two pipelines of 2 ranks on `pairs` (its own process groups), the others as one
    session over all ranks."""
    dp, dp_mode, pp, tp, schedule, stages, *rest = layout
    pipeline = PipelineConfig(pp=pp, schedule=schedule, n_microbatches=4, stages_per_rank=stages,
                              checkpoint=rest[0] if rest else "never")
    if pp == 2 and dp == 1 and tp == 1:
        group = pairs[dist.get_rank() // 2]
        return PipelineEngine(model, pipeline, device=device, pp_group=group, loss_fn=causal_lm_loss, seed=SEED,
                              metrics_group=group), 0
    session = build_session(model, ParallelConfig(dp=dp, dp_mode=dp_mode, tp=tp, pipeline=pipeline), device,
                            seed=SEED, loss_fn=causal_lm_loss)
    return session.engine, session.mesh.dp_rank


def compare_records(records: list[dict], ref: dict) -> set[str]:
    """Assert every rank's losses, gradients (per step) and final parameters equal the reference's within RTOL,
    ATOL; the parameter names seen."""
    seen = set()
    for record in records:
        torch.testing.assert_close(torch.tensor(record["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=ATOL)
        for step, grads in enumerate(record["grads"]):
            for name, grad in grads:
                torch.testing.assert_close(grad, ref["grads"][step][name], rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"step {step} gradient of {name}: {m}")
        for name, value in record["params"]:
            torch.testing.assert_close(value, ref["params"][name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
            seen.add(name)
    return seen


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def sgd_steps(engine, opt: torch.optim.Optimizer, keys: dict[str, str], replica: int,
              dp: int) -> tuple[list[float], list[list[tuple[str, torch.Tensor]]]]:
    """One step of `opt` on this replica's share of each of `make_batches(dp)`: the losses, and each step's whole
    gradients as (transformers name via `keys`, tensor) pairs."""
    losses, grads = [], []
    for x, labels in make_batches(dp):
        share = slice(replica * x.shape[0] // dp, (replica + 1) * x.shape[0] // dp)
        opt.zero_grad()
        losses.append(engine.step(x[share], labels[share]).loss)
        grads.append([(keys[n], _full(p.grad).clone()) for n, p in engine.named_parameters()])
        opt.step()
    return losses, grads


def _train(folder: str, layout: str, device: torch.device) -> dict:
    dp, dp_mode, pp, schedule = LAYOUTS[layout]
    model = HFCausalLM.from_folder(folder, seq_len=SEQ)
    pipeline = PipelineConfig(pp=pp, schedule=schedule, n_microbatches=4)
    parallel = ParallelConfig(dp=dp, dp_mode=dp_mode, pipeline=pipeline)
    session = build_session(model, parallel, device, seed=SEED, loss_fn=causal_lm_loss)
    engine, replica = session.engine, session.mesh.dp_rank
    keys = transformers_names(model)
    losses, grads = sgd_steps(engine, torch.optim.SGD(engine.parameters(), lr=LR), keys, replica, dp)
    grads = [dict(step) for step in grads]
    params = {keys[n]: _full(p.detach()).clone() for n, p in engine.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params}


def _worker(spec: RankSpec, folders: dict[str, str], tied_folders: dict[str, str], out: str) -> None:
    from tests.distributed.test_hf_tied import tied_records
    from tests.distributed.test_hf_tp import tp_records

    device = join_job(spec)
    try:
        records = {f"{family}-{layout}": _train(folder, layout, device) for family, folder in folders.items()
                   for layout in LAYOUTS}
        records.update(tied_records(tied_folders, device, Path(out)))  # test_hf_tied's cases, in the same job
        records.update(tp_records(folders, device, Path(out), tied_folders))  # and test_hf_tp's
        torch.save(records, Path(out) / f"rank{spec.rank}.pt")
    finally:
        close_session()


_SPAWNED: dict = {}


def spawned(tmp_path_factory) -> dict:
    """One job of 4 ranks for this module's cases, test_hf_tied's and test_hf_tp's (one start-up), run once."""
    if _SPAWNED:
        return _SPAWNED
    from tests.distributed.test_hf_tied import tied_configs, tied_setup

    root = tmp_path_factory.mktemp("hf")
    folders, references = _untied_setup(root)
    tied_folders, tied_references = tied_setup(root)
    spawn(_worker, ranks=range(4), world_size=4, master_addr="127.0.0.1", master_port=free_port(),
          args=(folders, tied_folders, str(root)), timeout_s=600)
    _SPAWNED.update(per_rank=[torch.load(root / f"rank{r}.pt") for r in range(4)], references=references,
                    tied_references=tied_references, root=root, tied_folders=tied_folders,
                    tied_vocab={family: config.vocab_size for family, config in tied_configs().items()})
    return _SPAWNED


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    job = spawned(tmp_path_factory)
    return job["per_rank"], job["references"]


def _untied_setup(root: Path) -> tuple[dict, dict]:
    folders, references = {}, {}
    for family, config in tiny_configs().items():
        torch.manual_seed(SEED)
        model = transformers.AutoModelForCausalLM.from_config(config)
        folders[family] = str(root / family)
        model.save_pretrained(folders[family])
        initial = {n: p.detach().clone() for n, p in model.state_dict().items()}
        for dp in (1, 2):
            model.load_state_dict(initial)
            references[family, dp] = reference(model, dp)
    return folders, references


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipelined_transformers_model_matches_unsplit(family, layout, runs):
    per_rank, references = runs
    ref = references[family, LAYOUTS[layout][0]]
    seen = set()
    for records in per_rank:
        record = records[f"{family}-{layout}"]
        torch.testing.assert_close(torch.tensor(record["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=ATOL)
        for step, grads in enumerate(record["grads"]):
            for name, grad in grads.items():
                torch.testing.assert_close(grad, ref["grads"][step][name], rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"step {step} gradient of {name}: {m}")
        for name, value in record["params"].items():
            torch.testing.assert_close(value, ref["params"][name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
            seen.add(name)
    assert seen == set(ref["params"]), f"parameters held by no rank: {sorted(set(ref['params']) - seen)}"
    # the steps changed the model far beyond the tolerance, so equal final parameters are not the initial ones
    moved = max((ref["params"][n] - ref["initial"][n]).abs().max().item() for n in ref["params"])
    assert moved > 100 * ATOL, f"the reference's parameters barely moved ({moved})"

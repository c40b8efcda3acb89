"""Hugging Face parity: a tiny Llama and a tiny GPT-2 pipelined over pp=2 equal the unsplit transformers model.

Each reference model is built from its config under a fixed seed and saved as a safetensors folder; every
rank builds only its own blocks from that folder (`HFCausalLM.from_folder`). Over three SGD steps (a full
batch, a short right-padded one that 4 micro-batches do not divide, and one smaller than 4): the loss on every rank, every
gradient at every step and every final parameter equal the transformers model's (`model(input_ids,
labels=input_ids).loss`) within the fp32 tolerance of the other parity tests (rtol 1e-5, atol 4e-5).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pipetrain.config import ParallelConfig, PipelineConfig  # noqa: E402
from pipetrain.launch.env import free_port  # noqa: E402
from pipetrain.launch.spawn import RankSpec, spawn  # noqa: E402
from pipetrain.session import build_session, close_session, join_job  # noqa: E402
from pipetrain.workloads.hf_causal_lm import HFCausalLM, causal_lm_loss  # noqa: E402

RTOL, ATOL = 1e-5, 4e-5
SEED, LR, VOCAB, SEQ = 0, 0.5, 96, 16
SIZES = [8, 6, 3]
SCHEDULES = ("gpipe", "1f1b")


def tiny_configs() -> dict:
    return {
        "llama": transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
        "gpt2": transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                        tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                        bos_token_id=0, eos_token_id=0),
    }


def make_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input ids, labels): sequences that follow a rule (each token is the previous one + 7). The second batch
    is right-padded to random lengths (padding labels -100), so micro-batches hold unequal token counts."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for index, n in enumerate(SIZES):
        ids = (torch.randint(0, VOCAB, (n, 1), generator=gen) + 7 * torch.arange(SEQ)) % VOCAB
        labels = ids.clone()
        if index == 1:
            padding = torch.arange(SEQ)[None] >= torch.randint(3, SEQ + 1, (n, 1), generator=gen)
            ids[padding], labels[padding] = 0, -100
        out.append((ids, labels))
    return out


def reference(model: torch.nn.Module) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    for x, labels in make_batches():
        opt.zero_grad()
        loss = model(input_ids=x, labels=labels).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _train(folder: str, schedule: str, device: torch.device) -> dict:
    model = HFCausalLM.from_folder(folder, seq_len=SEQ)
    parallel = ParallelConfig(pipeline=PipelineConfig(pp=2, schedule=schedule, n_microbatches=4))
    engine = build_session(model, parallel, device, seed=SEED, loss_fn=causal_lm_loss).engine
    keys = {}
    for index in range(model.num_blocks):
        keys.update({f"{index}.{local}": hf for local, hf in model.parameter_keys(index).items()})
    opt = torch.optim.SGD(engine.parameters(), lr=LR)
    losses, grads = [], []
    for x, labels in make_batches():
        opt.zero_grad()
        losses.append(engine.step(x, labels).loss)
        grads.append({keys[n]: p.grad.clone() for n, p in engine.named_parameters()})
        opt.step()
    return {"losses": losses, "grads": grads, "params": {keys[n]: p.detach().clone() for n, p in engine.named_parameters()}}


def _worker(spec: RankSpec, folders: dict[str, str], out: str) -> None:
    device = join_job(spec)
    try:
        records = {f"{family}-{s}": _train(folder, s, device) for family, folder in folders.items() for s in SCHEDULES}
        torch.save(records, Path(out) / f"rank{spec.rank}.pt")
    finally:
        close_session()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    folders, references = {}, {}
    for family, config in tiny_configs().items():
        torch.manual_seed(SEED)
        model = transformers.AutoModelForCausalLM.from_config(config)
        folders[family] = str(root / family)
        model.save_pretrained(folders[family])
        references[family] = reference(model)
    spawn(_worker, ranks=range(2), world_size=2, master_addr="127.0.0.1", master_port=free_port(),
          args=(folders, str(root)), timeout_s=600)
    return [torch.load(root / f"rank{r}.pt") for r in range(2)], references


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipelined_transformers_model_matches_unsplit(family, schedule, runs):
    per_rank, references = runs
    ref = references[family]
    seen = set()
    for records in per_rank:
        record = records[f"{family}-{schedule}"]
        torch.testing.assert_close(torch.tensor(record["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=ATOL)
        for step, grads in enumerate(record["grads"]):
            for name, grad in grads.items():
                torch.testing.assert_close(grad, ref["grads"][step][name], rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"step {step} gradient of {name}: {m}")
        for name, value in record["params"].items():
            torch.testing.assert_close(value, ref["params"][name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
            seen.add(name)
    assert seen == set(ref["params"]), f"parameters held by no rank: {sorted(set(ref['params']) - seen)}"
    # the steps changed the model materially, so equal final parameters are not just the initial ones
    assert max(ref["losses"]) - min(ref["losses"]) > 0.05, f"the reference's loss did not move: {ref['losses']}"

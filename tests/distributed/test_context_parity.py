"""Context parallelism: a tiny Llama (and GPT-2) with each sequence cut over 2 or 4 ranks equals the unsplit
transformers model on the same tokens.

One spawned job of 4 ranks runs every case in turn: ring attention at cp 4, cp 2 x pp 2 (1F1B, with and without
recomputation; interleaved 1F1B, 2 stages per rank) and cp 2 x dp 2 (DDP); all-to-all attention at cp 2 x pp 2 and cp 2 x dp 2 (FSDP2); packed documents
of unequal lengths crossing the parts' boundaries under both attentions (the reference: transformers' packed-sequence
mask from `position_ids`, so a document that saw another would change the loss and gradients). Over three SGD steps
(a full batch, a right-padded one, one smaller than the micro-batch count) the loss on every rank, every gradient of
every step and every final parameter equal the transformers model's within rtol 1e-5, atol 4e-5. The checkpoint
of cp 2 x pp 2 then loads at cp 4 (checkpoints are layout-free: cp does not split parameters).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pipetrain.checkpoint.state import load_checkpoint, save_checkpoint  # noqa: E402
from pipetrain.config import ParallelConfig, PipelineConfig  # noqa: E402
from pipetrain.launch.env import free_port  # noqa: E402
from pipetrain.launch.spawn import RankSpec, spawn  # noqa: E402
from pipetrain.session import build_session, close_session, join_job  # noqa: E402
from pipetrain.workloads.hf.causal_lm import HFCausalLM, causal_lm_loss  # noqa: E402
from tests.distributed.test_hf_parity import _full, compare_records, make_batches, tiny_configs  # noqa: E402
from tests.hf_folders import transformers_names  # noqa: E402

SEED, LR, SEQ = 0, 0.5, 16
#: case -> (family, dp, dp mode, pp, cp, attention, schedule, recomputation, packed documents)
CASES = {
    "llama-ring-cp4": ("llama", 1, "ddp", 1, 4, "ring", "gpipe", "never", False),
    "llama-ring-cp2xpp2": ("llama", 1, "ddp", 2, 2, "ring", "1f1b", "never", False),
    "llama-ring-cp2xpp2-recompute": ("llama", 1, "ddp", 2, 2, "ring", "1f1b", "always", False),
    "llama-ring-cp2xpp2-interleaved": ("llama", 1, "ddp", 2, 2, "ring", "interleaved-1f1b", "never", False),
    "llama-ring-cp2xdp2": ("llama", 2, "ddp", 1, 2, "ring", "gpipe", "never", False),
    "llama-ulysses-cp2xpp2": ("llama", 1, "ddp", 2, 2, "ulysses", "1f1b", "never", False),
    "llama-ulysses-cp2xdp2-fsdp": ("llama", 2, "fsdp", 1, 2, "ulysses", "gpipe", "never", False),
    "llama-ring-cp2xpp2-documents": ("llama", 1, "ddp", 2, 2, "ring", "1f1b", "never", True),
    "llama-ring-cp4-documents": ("llama", 1, "ddp", 1, 4, "ring", "gpipe", "never", True),
    "llama-ulysses-cp2xdp2-documents": ("llama", 2, "ddp", 1, 2, "ulysses", "gpipe", "never", True),
    "gpt2-ring-cp2xpp2": ("gpt2", 1, "ddp", 2, 2, "ring", "1f1b", "never", False),
    "llama-ring-cp2xdp2-fsdp": ("llama", 2, "fsdp", 1, 2, "ring", "gpipe", "never", False),
    "llama-ulysses-cp2xdp2": ("llama", 2, "ddp", 1, 2, "ulysses", "gpipe", "never", False),
}


#: the case whose checkpoint is loaded at another cp
RESUMED = "llama-ring-cp2xpp2"


def document_positions(n: int, seed: int) -> torch.Tensor:
    """Per-row positions of packed documents of unequal lengths (1 to 9 tokens), restarting at each document."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        row: list[int] = []
        while len(row) < SEQ:
            row += range(int(torch.randint(1, 10, (1,), generator=gen)))
        rows.append(row[:SEQ])
    return torch.tensor(rows)


def batches(dp: int, documents: bool) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """test_hf_parity's batches (inputs as a tuple), with per-document positions when `documents`."""
    out = []
    for step, (ids, labels) in enumerate(make_batches(dp)):
        out.append(((ids, document_positions(ids.shape[0], step)) if documents else (ids,), labels))
    return out


def reference(model: torch.nn.Module, dp: int, documents: bool) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    for inputs, labels in batches(dp, documents):
        opt.zero_grad()
        # packed: transformers masks by document from the positions only without a cache (use_cache=False)
        extra = {"position_ids": inputs[1], "use_cache": False} if documents else {}
        loss = model(input_ids=inputs[0], labels=labels, **extra).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _train(folder: str, case: str, device: torch.device, save: Path | None = None) -> dict:
    _, dp, dp_mode, pp, cp, attention, schedule, recompute, documents = CASES[case]
    model = HFCausalLM.from_folder(folder, seq_len=SEQ, documents=documents)
    pipeline = PipelineConfig(pp=pp, schedule=schedule, n_microbatches=4, checkpoint=recompute)
    parallel = ParallelConfig(dp=dp, dp_mode=dp_mode, pipeline=pipeline, cp=cp, cp_attention=attention)
    session = build_session(model, parallel, device, seed=SEED, loss_fn=causal_lm_loss)
    engine, replica = session.engine, session.mesh.dp_rank
    keys = transformers_names(model)
    opt = torch.optim.SGD(engine.parameters(), lr=LR)
    losses, grads = [], []
    for inputs, labels in batches(dp, documents):
        share = slice(replica * labels.shape[0] // dp, (replica + 1) * labels.shape[0] // dp)
        opt.zero_grad()
        losses.append(engine.step(tuple(t[share] for t in inputs), labels[share]).loss)
        grads.append([(keys[n], _full(p.grad).clone()) for n, p in engine.named_parameters()])
        opt.step()
    params = [(keys[n], _full(p.detach()).clone()) for n, p in engine.named_parameters()]
    if save is not None:
        save_checkpoint(save, engine, opt, step=3, model_name="llama")
    return {"losses": losses, "grads": grads, "params": params}


def _resumed(folder: str, saved: Path, device: torch.device) -> list:
    """The parameters of a checkpoint written at cp 2 x pp 2, loaded at cp 4 (pp 1)."""
    model = HFCausalLM.from_folder(folder, seq_len=SEQ)
    parallel = ParallelConfig(pipeline=PipelineConfig(pp=1), cp=4)
    engine = build_session(model, parallel, device, seed=SEED + 1, loss_fn=causal_lm_loss).engine
    load_checkpoint(saved, engine, torch.optim.SGD(engine.parameters(), lr=LR), model_name="llama")
    keys = transformers_names(model)
    return [(keys[n], p.detach().clone()) for n, p in engine.named_parameters()]


def _worker(spec: RankSpec, folders: dict[str, str], cases: list[str], out: str) -> None:
    device = join_job(spec)
    try:
        saved = Path(out) / "saved-cp2xpp2"
        records = {case: _train(folders[CASES[case][0]], case, device, saved if case == RESUMED else None)
                   for case in cases}
        if RESUMED in cases:
            records["resumed"] = _resumed(folders["llama"], saved, device)
        torch.save(records, Path(out) / f"rank{spec.rank}.pt")
    finally:
        close_session()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return spawned(tmp_path_factory.mktemp("cp"), list(CASES))


def spawned(root: Path, cases: list[str]) -> tuple[list[dict], dict]:
    """The per-rank records of `cases` (one job of 4 ranks) and the references."""
    folders, references = {}, {}
    for family, config in tiny_configs().items():
        torch.manual_seed(SEED)
        model = transformers.AutoModelForCausalLM.from_config(config)
        folders[family] = str(root / family)
        model.save_pretrained(folders[family])
        initial = {n: p.detach().clone() for n, p in model.state_dict().items()}
        for dp in (1, 2):
            for documents in (False, True):
                model.load_state_dict(initial)
                references[family, dp, documents] = reference(model, dp, documents)
    spawn(_worker, ranks=range(4), world_size=4, master_addr="127.0.0.1", master_port=free_port(),
          args=(folders, cases, str(root)), timeout_s=900)
    return [torch.load(root / f"rank{r}.pt") for r in range(4)], references


@pytest.mark.parametrize("case", list(CASES))
def test_context_parallel_matches_unsplit(case, runs):
    per_rank, references = runs
    family, dp, *_, documents = CASES[case]
    ref = references[family, dp, documents]
    seen = compare_records([records[case] for records in per_rank], ref)
    assert seen == set(ref["params"]), f"parameters held by no rank: {sorted(set(ref['params']) - seen)}"


def test_documents_reference_differs_from_one_sequence(runs):
    """The packed cases can fail: the reference with documents is not the reference of one long sequence."""
    _, references = runs
    assert abs(references["llama", 1, True]["losses"][0] - references["llama", 1, False]["losses"][0]) > 1e-3


def test_checkpoint_written_at_cp2_resumes_at_cp4(runs):
    """Layout-free checkpoints: parameters are not split by cp, so cp 2 x pp 2's checkpoint loads at cp 4."""
    per_rank, references = runs
    ref = references["llama", 1, False]["params"]
    for records in per_rank:
        loaded = dict(records["resumed"])
        assert set(loaded) == set(ref)
        for name, value in loaded.items():
            torch.testing.assert_close(value, ref[name], rtol=1e-5, atol=4e-5, msg=lambda m: f"{name}: {m}")

"""SmolLM2-135M (a real pretrained model, 30 layers, tied embeddings) split in two: the cheapest meaningful slice of
the documented fine-tuning run (docs/models.md).

Two spawned ranks (pp=2, 1F1B, 2 micro-batches) build their halves from the converted folder (each reading only
its own tensors), take one batch of 2 windows of 32 tokens of English text tokenized by the model's own
tokenizer, and make two AdamW steps on it. The first step's loss equals the unsplit transformers model's
(`model(input_ids, labels=input_ids).loss`) on the same batch within 1e-4 (fp32 over 30 layers; measured
differences are ~1e-6) and is that of a pretrained model (below 5 nats, where random weights give ~10.8);
the second step's loss is lower. Skipped where the folder is not prepared: `python -m pipetrain.workloads.hf.smollm2
prepare` (make test does it once, ~540 MB under ~/.cache/pipetrain).
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
from pipetrain.workloads.hf.causal_lm import HFCausalLM, causal_lm_loss  # noqa: E402
from pipetrain.workloads.hf.smollm2 import prepared_folder  # noqa: E402

FOLDER = prepared_folder()
pytestmark = pytest.mark.skipif(FOLDER is None, reason="SmolLM2 not prepared: python -m pipetrain.workloads.hf.smollm2 prepare")
SEQ, TOLERANCE = 32, 1e-4
TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
        "of a wife. However little known the feelings or views of such a man may be on his first entering a "
        "neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is considered "
        "the rightful property of some one or other of their daughters.")


def batch(folder: Path) -> torch.Tensor:
    ids = transformers.AutoTokenizer.from_pretrained(folder)(TEXT, add_special_tokens=False)["input_ids"]
    return torch.tensor([ids[:SEQ], ids[SEQ : 2 * SEQ]])


def _worker(spec: RankSpec, folder: str, out: str) -> None:
    device = join_job(spec)
    try:
        model = HFCausalLM.from_folder(folder, seq_len=SEQ)
        parallel = ParallelConfig(pipeline=PipelineConfig(pp=2, schedule="1f1b", n_microbatches=2))
        engine = build_session(model, parallel, device, loss_fn=causal_lm_loss).engine
        opt = torch.optim.AdamW(engine.parameters(), lr=1e-4, weight_decay=0.0)
        ids, losses = batch(Path(folder)), []
        for _ in range(2):
            opt.zero_grad()
            losses.append(engine.step(ids, ids).loss)
            opt.step()
        if spec.rank == 0:
            torch.save(losses, Path(out) / "losses.pt")
    finally:
        close_session()


def test_smollm2_at_pp2_matches_the_unsplit_model_and_learns(tmp_path):
    spawn(_worker, ranks=range(2), world_size=2, master_addr="127.0.0.1", master_port=free_port(),
          args=(str(FOLDER), str(tmp_path)), timeout_s=240)
    losses = torch.load(tmp_path / "losses.pt")
    ids = batch(FOLDER)
    unsplit = transformers.AutoModelForCausalLM.from_pretrained(FOLDER).eval()
    with torch.no_grad():
        reference = unsplit(input_ids=ids, labels=ids).loss.item()
    assert abs(losses[0] - reference) < TOLERANCE, (losses, reference)
    assert reference < 5.0, f"loss {reference}: not a pretrained model's"
    assert losses[1] < losses[0], losses

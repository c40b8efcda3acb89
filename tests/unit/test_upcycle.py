"""Sparse upcycling (`python -m pipetrain.workloads.hf.upcycle`): the Mixtral folder computes the dense folder's
logits at step 0 (experts are copies of the MLP, top-k weights sum to one), is written per expert on disk as
transformers writes Mixtral, and a folder that cannot be upcycled is one line, exit 2."""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from pipetrain.workloads.hf.upcycle import main, upcycle  # noqa: E402
from tests.hf_folders import tiny_model_folder  # noqa: E402


def test_the_mixture_computes_the_dense_model_at_step_zero(tmp_path):
    dense_dir = tiny_model_folder(tmp_path / "dense", layers=2)
    moe_dir = upcycle(dense_dir, tmp_path / "moe", experts=4, top_k=2, seed=1)
    config = json.loads((moe_dir / "config.json").read_text())
    assert config["model_type"] == "mixtral" and config["num_local_experts"] == 4
    assert config["num_experts_per_tok"] == 2 and config["tie_word_embeddings"] is True
    assert (moe_dir / "tokenizer.json").is_file()
    dense = transformers.AutoModelForCausalLM.from_pretrained(dense_dir).eval()
    moe = transformers.AutoModelForCausalLM.from_pretrained(moe_dir).eval()
    router = moe.model.layers[0].mlp.gate.weight
    assert router.abs().sum() > 0  # a fresh router, not zeros: tokens are spread over the experts
    ids = torch.randint(0, dense.config.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(moe(ids).logits, dense(ids).logits, rtol=1e-5, atol=1e-5)
        routed = moe.model.layers[0].mlp.gate(moe.model.embed_tokens(ids))[2]
    assert len(routed.unique()) > 2  # more than the first top-k experts take tokens


def test_a_folder_it_cannot_upcycle_is_one_line(tmp_path, capsys):
    gpt2 = tiny_model_folder(tmp_path / "gpt2", family="gpt2")
    assert main([str(gpt2), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "upcycling takes a Llama- or Mistral-shaped model" in err and "'gpt2' one" in err
    assert main([str(tiny_model_folder(tmp_path / "llama")), str(tmp_path / "out"), "--top-k", "5"]) == 2
    assert "--top-k 5 with --experts 4" in capsys.readouterr().err

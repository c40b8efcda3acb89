"""The Hugging Face adapter without processes: blocks chained by hand equal the transformers model; bad input."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pipetrain.blocks import build_blocks, build_sequential  # noqa: E402
from pipetrain.errors import ConfigError  # noqa: E402
from pipetrain.workloads.hf import causal_lm as hf_causal_lm  # noqa: E402
from pipetrain.workloads.hf.causal_lm import HFCausalLM, causal_lm_loss  # noqa: E402
from tests.distributed.test_hf_parity import SEQ, VOCAB, tiny_configs  # noqa: E402


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """family -> (saved folder, the transformers model saved there)."""
    root = tmp_path_factory.mktemp("hf-unit")
    out = {}
    for family, config in tiny_configs().items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
        model.save_pretrained(root / family)
        out[family] = (root / family, model)
    return out


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_blocks_chained_by_hand_equal_the_transformers_model(family, folders):
    folder, reference = folders[family]
    chain = build_sequential(HFCausalLM.from_folder(folder, seq_len=SEQ), seed=0)
    x = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(0))
    expected = reference(input_ids=x, labels=x)
    logits = chain(x)
    torch.testing.assert_close(logits, expected.logits, rtol=1e-5, atol=4e-5)
    torch.testing.assert_close(causal_lm_loss(logits, x), expected.loss, rtol=1e-5, atol=4e-5)


def test_a_rank_reads_only_its_own_tensors(folders, monkeypatch):
    folder, _ = folders["llama"]
    model = HFCausalLM.from_folder(folder, seq_len=SEQ)
    read: list[str] = []
    original = hf_causal_lm._Checkpoint.read
    monkeypatch.setattr(hf_causal_lm._Checkpoint, "read", lambda self, key: read.append(key) or original(self, key))
    build_blocks(model, [2, 3], seed=0)  # the second decoder layer and the head: the last stage of pp=2
    assert read and all(k.startswith(("model.layers.1.", "model.norm.", "lm_head.")) for k in read), read
    assert not any(k.startswith(("model.embed_tokens", "model.layers.0.")) for k in read)


def test_untrained_blocks_follow_the_transformers_initialisation():
    model = HFCausalLM(tiny_configs()["gpt2"], seq_len=SEQ)
    first, again = build_blocks(model, [1], seed=0)[0], build_blocks(model, [1], seed=0)[0]
    weight = first.layer.attn.c_attn.weight
    torch.testing.assert_close(weight, again.layer.attn.c_attn.weight)  # same seed, same block, any rank
    assert abs(weight.std().item() - 0.02) < 0.003
    assert torch.equal(first.layer.ln_1.weight, torch.ones(32))


def test_unsupported_model_type_names_the_supported_ones():
    with pytest.raises(ConfigError, match="model type 'bert' is not supported") as err:
        HFCausalLM(transformers.BertConfig())
    assert "llama, gpt2" in err.value.hint


def test_checkpoint_folder_of_another_model(folders):
    gpt2_folder, _ = folders["gpt2"]
    with pytest.raises(ConfigError, match="holds another model: its model_type is 'gpt2'"):
        HFCausalLM(tiny_configs()["llama"], checkpoint=gpt2_folder)
    bigger = tiny_configs()["llama"]
    bigger.vocab_size = 128
    llama_folder, _ = folders["llama"]
    with pytest.raises(ConfigError, match="vocab_size is 96"):
        HFCausalLM(bigger, checkpoint=llama_folder)


def test_folder_without_weights(tmp_path):
    with pytest.raises(ConfigError, match="no model.safetensors"):
        HFCausalLM(tiny_configs()["llama"], checkpoint=tmp_path)


@pytest.mark.parametrize("preset", ["llama-tiny", "gpt2-tiny"])
def test_hf_workload_trains_on_the_language_model_corpus(preset):
    """`pipetrain train --workload hf`: the model of a preset, the lm corpus, its next-token targets."""
    from pipetrain.workloads.registry import DataRequest, get_workload

    workload = get_workload("hf")
    model = workload.model(preset)
    train, _ = workload.load_data(DataRequest(preset=preset, path=None, synthetic=True, train_samples=16,
                                                test_samples=4, seed=0))
    x, y = next(workload.batches(train, 8, shuffle=False, seed=0, epoch=0, replica=0, replicas=1))
    net = build_sequential(model, seed=0)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = workload.loss().total(net(x), y) / workload.loss().count(y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses


def test_hf_workload_refuses_an_unknown_preset():
    from pipetrain.workloads.registry import get_workload

    with pytest.raises(ConfigError, match="unknown preset 'llama-7b'"):
        get_workload("hf").model("llama-7b")

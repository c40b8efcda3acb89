"""Packing by document (`--pack documents`): best fit decreasing keeps every document whole in one window; each
document's positions restart at 0 and its targets are its own next tokens (its untrained tokens and the padding
ignored); the unsplit pipetrain blocks give a packed window the loss of its documents each run alone through the
transformers model (sum of token losses, rtol 1e-5), and the same check fails when the positions do not restart or
the mask does not follow the documents. The CLI flag, its efficiency figure in the start-up line, and `data show`.
The parity under every layout: tests/distributed/test_packing_parity.py."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pipetrain.blocks import build_sequential  # noqa: E402
from pipetrain.data.packing import IGNORE, PackedDocuments, pack_documents, pack_lengths  # noqa: E402
from pipetrain.pipeline.shapes import sequence_shard  # noqa: E402
from pipetrain.workloads.hf import blocks as hf_blocks  # noqa: E402
from pipetrain.workloads.hf.causal_lm import HFCausalLM  # noqa: E402

VOCAB, SEQ = 96, 24


@dataclass(frozen=True)
class Documents:
    """Documents as a `--pack none` split gives them: `[n, SEQ + 1]` tokens, lengths, which tokens train."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    trained: torch.Tensor
    pad_id: int = 0
    source: str = "test documents"
    supervised: bool = True

    def take(self, part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[part], self.trained[part]

    def labels(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Document `i` alone as transformers trains it: (input ids, labels with untrained tokens -100)."""
        length = int(self.lengths[i])
        ids = self.tokens[i, :length]
        return ids, torch.where(self.trained[i, :length], ids, IGNORE)


def make_documents(count: int, seed: int = 0) -> Documents:
    """`count` documents of 2 to SEQ + 1 tokens, a prompt of 0 to 3 untrained tokens in some (at least one trains)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, SEQ + 2, (count,), generator=gen)
    tokens = torch.randint(1, VOCAB, (count, SEQ + 1), generator=gen)
    prompts = torch.randint(0, 4, (count,), generator=gen).clamp(max=lengths - 2)
    at = torch.arange(SEQ + 1)[None]
    tokens[at >= lengths[:, None]] = 0
    trained = (at >= prompts[:, None]) & (at < lengths[:, None])
    return Documents(tokens, lengths, trained)


def test_best_fit_decreasing_keeps_every_document_whole_and_fills_the_windows():
    sizes = [7, 5, 3, 9, 2, 2, 6, 4, 8, 1]
    bins = pack_lengths(sizes, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(sizes)))  # each document once
    assert all(sum(sizes[i] for i in b) <= 10 for b in bins)
    assert len(bins) == -(-sum(sizes) // 10) == 5  # as few windows as the tokens need, here
    assert bins == pack_lengths(sizes, 10)  # a function of the lengths alone
    with pytest.raises(ValueError, match="does not fit"):
        pack_lengths([11], 10)


def test_a_window_restarts_positions_at_each_document_and_trains_on_its_own_next_tokens():
    docs = make_documents(30)
    packed = pack_documents(docs, seq_len=SEQ)
    assert sorted(packed.members.tolist()) == list(range(30))
    ids, positions, targets = packed.take(torch.arange(len(packed)))
    assert packed.num_tokens == int((docs.lengths - 1).sum())
    assert 0.5 < packed.efficiency <= 1.0 and f"packing efficiency {packed.efficiency:.1%}" in packed.source
    for w in range(len(packed)):
        at = 0
        for d in packed.members[packed.bounds[w] : packed.bounds[w + 1]].tolist():
            used = int(docs.lengths[d]) - 1
            doc_ids, labels = docs.labels(d)
            assert positions[w, at : at + used].tolist() == list(range(used))
            assert ids[w, at : at + used].tolist() == doc_ids[:-1].tolist()
            assert targets[w, at : at + used].tolist() == labels[1:].tolist()  # untrained: -100
            at += used
        assert positions[w, at:].tolist() == list(range(SEQ - at))  # padding: a run of its own
        assert (targets[w, at:] == IGNORE).all()


def _configs() -> dict:
    return {"llama": transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=64,
                                              initializer_range=0.1),  # attention far from uniform
            "gpt2": transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                            tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                            bos_token_id=0, eos_token_id=0, initializer_range=0.1)}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """family -> (the transformers model, pipetrain's unsplit blocks of the same weights)."""
    out = {}
    for family, config in _configs().items():
        torch.manual_seed(0)
        reference = transformers.AutoModelForCausalLM.from_config(config).eval()
        folder = tmp_path_factory.mktemp(family)
        reference.save_pretrained(folder)
        out[family] = (reference, build_sequential(HFCausalLM.from_folder(folder, seq_len=SEQ, documents=True), seed=0))
    return out


def _packed_and_alone(family: str, models: dict, packed: PackedDocuments, docs: Documents) -> tuple[float, float]:
    """The packed windows' summed token loss through pipetrain's blocks; the documents' each run alone."""
    reference, net = models[family]
    ids, positions, targets = packed.take(torch.arange(len(packed)))
    with torch.no_grad():
        logits = net(ids, positions)
        total = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE,
                                                  reduction="sum")
        alone = 0.0
        for d in range(len(docs.lengths)):
            doc_ids, labels = docs.labels(d)
            trained = int((labels[1:] != IGNORE).sum())
            alone += reference(input_ids=doc_ids[None], labels=labels[None]).loss.item() * trained
    return total.item(), alone


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_packed_window_has_the_loss_of_its_documents_each_run_alone(family, models):
    docs = make_documents(12, seed=1)
    packed = pack_documents(docs, seq_len=SEQ)
    assert any(int(packed.bounds[w + 1] - packed.bounds[w]) >= 3 for w in range(len(packed)))  # really packed
    total, alone = _packed_and_alone(family, models, packed, docs)
    assert total == pytest.approx(alone, rel=1e-5)


@pytest.mark.parametrize("wrong", ["positions-run-on", "mask-across-documents"])
def test_the_parity_check_fails_when_positions_do_not_restart_or_the_mask_ignores_documents(wrong, models,
                                                                                            monkeypatch):
    docs = make_documents(12, seed=1)
    packed = pack_documents(docs, seq_len=SEQ)
    if wrong == "positions-run-on":  # one position per slot of the window, as windows packing has
        take = PackedDocuments.take
        monkeypatch.setattr(PackedDocuments, "take", lambda self, part: (lambda i, p, t: (
            i, torch.arange(SEQ).expand_as(p).contiguous(), t))(*take(self, part)))
    else:  # positions restart, but the mask is the plain causal one
        monkeypatch.setattr(hf_blocks, "document_mask", lambda family_mask, config, hidden, positions, index:
                            family_mask(config, hidden, index))
    total, alone = _packed_and_alone("llama", models, packed, docs)
    print(wrong, total, alone, abs(total - alone) / alone)
    assert total != pytest.approx(alone, rel=1e-5)  # the parity above fails
    assert abs(total - alone) > 1e-3 * alone  # by 100 times its tolerance or more


def test_sequence_parallel_sends_the_positions_whole():
    """Under sequence parallelism a stage sends its float activations cut along the sequence, integer tensors (the
    positions, from which a layer builds the mask over the whole sequence) whole."""
    hidden, positions = torch.zeros(2, 8, 4), torch.arange(8).expand(2, 8)
    sent = sequence_shard((hidden, positions), 2)
    assert sent[0].shape == (2, 4, 4) and sent[1].shape == (2, 8)


def test_data_show_prints_packed_windows_a_document_a_line_and_the_efficiency(tmp_path, monkeypatch, capsys):
    pytest.importorskip("datasets")
    from pipetrain.cli.main import main
    from pipetrain.data import cache as data_cache
    from tests.hf_folders import tiny_model_folder

    monkeypatch.setattr(data_cache, "default_cache_root", lambda: tmp_path / "cache")
    folder = tiny_model_folder(tmp_path / "model")
    words = "the cat sat on the mat and the dog ran far away from home".split()
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"text": " ".join(words[(i + k) % len(words)] for k in range(3 + i % 9))}) + "\n"
                            for i in range(40)))
    capsys.readouterr()
    argv = ["--model", str(folder), "--data", str(data), "--pack", "documents", "--seq-len", "64"]
    assert main(["data", "show", *argv, "--rows", "2"]) == 0  # the start-up line of train says the same source
    shown = capsys.readouterr().out
    print(shown)
    assert "packed by document into" in shown and "packing efficiency" in shown
    assert "--- window 0:" in shown and shown.count("\n| ") >= 3  # a window of two documents or more, one a line


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_another_familys_mask_and_the_documents_give_transformers_packed_mask(attention):
    """A family whose mask is not the causal builder (a sliding window, say) gets its own mask and-ed with the
    same-document blocks: with a window longer than the sequence, transformers' packed-sequence mask exactly."""
    from pipetrain.workloads.hf.families import causal_mask

    config = _configs()["llama"]
    config._attn_implementation = attention
    masks = transformers.masking_utils
    hidden, positions = torch.zeros(2, 10, 32), torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 0], list(range(10))])

    def kept_whole(config, hidden, index):  # a 4-D mask (bool for sdpa, additive for eager) of plain causality
        return masks.create_causal_mask(config=config, inputs_embeds=hidden, attention_mask=None, cache=None,
                                        allow_is_causal_skip=False)

    def skipped(config, hidden, index):  # sdpa's None: is_causal
        return masks.create_causal_mask(config=config, inputs_embeds=hidden, attention_mask=None, cache=None)

    expected = hf_blocks.document_mask(causal_mask, config, hidden, positions, 0)
    assert expected is not None and expected.shape == (2, 1, 10, 10)
    for family_mask in (kept_whole, skipped):
        got = hf_blocks.document_mask(family_mask, config, hidden, positions, 0)
        torch.testing.assert_close(got, expected)
    allowed = expected if expected.dtype == torch.bool else expected == 0
    assert allowed[0, 0, 4].tolist() == [False] * 3 + [True] * 2 + [False] * 5  # its own document's earlier tokens
    assert allowed[1, 0].equal(torch.ones(10, 10, dtype=torch.bool).tril())  # one document: causal


def test_packed_windows_keep_the_data_position_under_any_replica_count():
    """The windows are a function of the lengths, so a resumed run under another dp seeks to the same windows."""
    from pipetrain.workloads.hf.text import window_batches

    packed = pack_documents(make_documents(60, seed=2), seq_len=SEQ)
    batch = 4
    again = pack_documents(make_documents(60, seed=2), seq_len=SEQ)
    assert len(packed) % batch == 0 and again.members.equal(packed.members) and again.bounds.equal(packed.bounds)

    def joined(replicas: int, start: int) -> list[torch.Tensor]:
        shares = [list(window_batches(packed, batch, shuffle=True, seed=5, epoch=2, replica=r, replicas=replicas,
                                      start=start)) for r in range(replicas)]
        return [torch.cat([torch.stack([s[i][0][0], s[i][0][1], s[i][1]]) for s in shares], dim=1)
                for i in range(len(shares[0]))]

    whole = joined(1, 0)
    for replicas in (2, 4):
        for start in (0, 2 * batch):
            got = joined(replicas, start)
            assert len(got) == len(whole) - start // batch
            assert all(g.equal(w) for g, w in zip(got, whole[start // batch :]))


@pytest.mark.parametrize("written, pack", [("true", "windows"), ("false", "none"), ('"documents"', "documents")])
def test_a_config_file_of_the_switch_and_of_the_mode_gives_the_packing(written, pack, tmp_path):
    """`pack = true/false`, as --print-config wrote it when --pack was a switch, still means windows / none."""
    from pipetrain.cli.config_file import apply_config_file
    from pipetrain.cli.main import build_parser

    path = tmp_path / "run.toml"
    path.write_text(f"pack = {written}\n")
    argv = ["train", "--config", str(path)]
    parser = build_parser(argv)
    assert apply_config_file(parser, argv, parser.parse_args(argv)).pack == pack

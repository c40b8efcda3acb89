"""`--objective dpo` without processes: TRL's preference rows as pairs (text and chat, answer tokens only), the bad
rows and flags refused in one line, the targets' float columns kept bit for bit, and the pipetrain loss of a batch
equal to TRL's formulas computed by hand on the same log-probabilities."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
pytest.importorskip("datasets")

from pipetrain.cli.main import main as cli_main  # noqa: E402
from pipetrain.errors import ConfigError, DataError  # noqa: E402
from pipetrain.objectives import DPOSettings, PreferenceLoss, pair_terms, read_pairs  # noqa: E402
from pipetrain.objectives.columns import split_columns, with_columns  # noqa: E402
from pipetrain.objectives.pairs import pair_ids  # noqa: E402
from pipetrain.objectives.preference import check_pair_batches  # noqa: E402
from tests.hf_folders import chat_tokenizer, tiny_tokenizer  # noqa: E402


def _rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_float_columns_travel_bit_for_bit_beside_the_labels():
    labels = torch.tensor([[1, -100, 3], [4, 5, -100]])
    values = torch.tensor([-28.123456789012345, float("-inf")], dtype=torch.float64)
    back_labels, back = split_columns(with_columns(labels, values), 1)
    assert torch.equal(back_labels, labels) and torch.equal(back[:, 0], values)


def test_text_pairs_train_the_answers_and_their_eos_only(tmp_path):
    tok = tiny_tokenizer()
    head, chosen, rejected = pair_ids({"prompt": "The cat", "chosen": " sat.", "rejected": " ran"}, 0, tok, "t")
    assert head == tok("The cat")["input_ids"]
    assert head + chosen == tok("The cat sat." + tok.eos_token)["input_ids"] and chosen[-1] == tok.eos_token_id
    assert rejected[-1] == tok.eos_token_id
    rows = [{"prompt": f"The cat {i}", "chosen": " sat.", "rejected": " ran away"} for i in range(20)]
    train, test = read_pairs(_rows(tmp_path / "p.jsonl", rows), tok, seq_len=24, pad_id=0)
    assert (len(train), len(test)) == (18, 2)
    x, targets = train.take(torch.tensor([0, 1]))
    labels, reference = split_columns(targets, 1)
    assert x.shape == (4, 24) and labels.shape == (4, 24) and torch.isnan(reference).all()
    answer = train.trained[0, 0]
    assert labels[0][answer[1:]].tolist() == train.tokens[0, 0, 1:][answer[1:]].tolist()
    assert (labels[0][~answer[1:]] == -100).all()


def test_chat_pairs_render_the_template_and_an_implicit_prompt_is_split():
    tok = chat_tokenizer()
    user = [{"role": "user", "content": "The cat?"}]
    explicit = {"prompt": user, "chosen": [{"role": "assistant", "content": "sat"}],
                "rejected": [{"role": "assistant", "content": "ran"}]}
    implicit = {"chosen": user + explicit["chosen"], "rejected": user + explicit["rejected"]}
    head, chosen, _ = pair_ids(explicit, 0, tok, "t")
    assert pair_ids(implicit, 0, tok, "t") == pair_ids(explicit, 0, tok, "t")
    assert tok.decode(head).endswith("<|im_start|>assistant\n") and tok.decode(chosen).startswith("sat<|im_end|>")


@pytest.mark.parametrize("row, says", [
    ({"prompt": "a", "chosen": " ", "rejected": "b"}, "row 1 of t: the chosen answer is empty"),
    ({"prompt": "a", "chosen": "b", "rejected": ""}, "row 1 of t: the rejected answer is empty"),
    ({"chosen": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
      "rejected": [{"role": "user", "content": "z"}, {"role": "assistant", "content": "w"}]},
     "row 1 of t: chosen and rejected have different prompts"),
    ({"prompt": [{"role": "user", "content": "x"}],
      "chosen": [{"role": "user", "content": "z"}, {"role": "assistant", "content": "y"}],
      "rejected": [{"role": "assistant", "content": "w"}]},
     "row 1 of t: chosen holds 'user' turns beside its 'prompt'"),
    ({"prompt": [{"role": "user", "content": "x"}], "chosen": [{"role": "assistant", "content": "y"}],
      "rejected": [{"role": "assistant", "content": " "}]}, "row 1 of t: the rejected answer is empty"),
])
def test_bad_pairs_are_refused_naming_the_row(row, says):
    """Rows are numbered from 1, as an editor numbers lines (main said "row 0" for the first)."""
    with pytest.raises(DataError) as err:
        pair_ids(row, 0, chat_tokenizer(), "t")
    assert err.value.message.startswith(says)


def test_a_chat_role_the_template_does_not_know_is_refused_naming_the_roles():
    """A misspelled role trained without a word (fails on main), as it did for chat rows before issue 35."""
    row = {"prompt": [{"role": "usr", "content": "The cat?"}], "chosen": [{"role": "assistant", "content": "sat"}],
           "rejected": [{"role": "assistant", "content": "ran"}]}
    with pytest.raises(DataError) as err:
        pair_ids(row, 4, chat_tokenizer(), "t")
    assert err.value.message.startswith("row 5 of t has the role(s) 'usr', which the chat template does not know")
    assert "accepted: assistant, system, tool, user" in err.value.message and "'usr' -> 'user'" in err.value.hint


def test_a_bad_line_is_one_message_without_the_readers_progress_bars(tmp_path, capfd, monkeypatch):
    """Fails on main: `datasets`' "Generating train split" bars came before the message (the rows of SFT were read
    with them off; those of DPO and GRPO were not)."""
    from pipetrain.objectives import pairs

    monkeypatch.setattr(pairs, "default_cache_root", lambda: tmp_path / "cache")
    good = json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"})
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join((good if i != 2 else '{"prompt": "a') + "\n" for i in range(12)))
    capfd.readouterr()
    with pytest.raises(DataError) as err:
        read_pairs(data, tiny_tokenizer(), seq_len=24, pad_id=0)
    assert err.value.message.startswith(f"line 3 of {str(data)!r} is not one JSON object")
    said = capfd.readouterr()
    assert "Generating" not in said.err + said.out, said.err


def test_rows_without_chosen_and_rejected_are_refused(tmp_path):
    rows = _rows(tmp_path / "sums.jsonl", [{"prompt": f"{i} plus 1 is", "answer": str(i + 1)} for i in range(12)])
    with pytest.raises(ConfigError) as err:
        read_pairs(rows, tiny_tokenizer(), seq_len=24, pad_id=0)
    assert err.value.message.startswith(f"--data {str(rows)!r} has no 'chosen' and no 'rejected' field: the fields "
                                        "found are 'prompt', 'answer'") and "preference format" in err.value.hint


def test_bad_flags_are_refused():
    with pytest.raises(ConfigError, match="a preference pair must stay in one micro-batch"):
        check_pair_batches(6, 1, 4)
    check_pair_batches(8, 2, 2)
    with pytest.raises(ConfigError, match="--label-smoothing 0.1 does not apply to --dpo-loss sigmoid"):
        DPOSettings(loss="sigmoid", label_smoothing=0.1)
    with pytest.raises(ConfigError, match="--dpo-loss 'kto'"):
        DPOSettings(loss="kto")


def test_dpo_flags_without_the_objective_are_refused(capsys):
    assert cli_main(["train", "--workload", "hf", "--preset", "llama-tiny", "--dpo-beta", "0.3"]) == 2
    assert "--dpo-beta applies to preference pairs, but --objective dpo is not given" in capsys.readouterr().err


def _trl_sigmoid(c, r, c0, r0, beta):
    return -F.logsigmoid(beta * ((c - c0) - (r - r0)))


def test_the_loss_of_a_batch_is_the_mean_of_trls_pair_losses():
    torch.manual_seed(0)
    logits = torch.randn(4, 6, 11, dtype=torch.float64)
    labels = torch.randint(0, 11, (4, 6))
    labels[:, :2] = -100
    labels[1, 5] = -100  # answers of unequal lengths
    reference = torch.tensor([-9.0, -8.0, -7.5, -9.5], dtype=torch.float64)
    loss = PreferenceLoss(DPOSettings(loss="sigmoid", beta=0.3))
    targets = with_columns(labels, reference)
    logps = (torch.gather(logits.log_softmax(-1), -1, labels.clamp(min=0)[..., None])[..., 0] * (labels >= 0)).sum(1)
    expected = _trl_sigmoid(logps[0::2], logps[1::2], reference[0::2], reference[1::2], 0.3)
    assert loss.count(targets) == 2
    torch.testing.assert_close(loss.total(logits, targets), expected.sum())
    counts = (labels >= 0).sum(1).double()  # 4, 3, 4, 4 answer tokens
    terms = pair_terms(DPOSettings(loss="ipo", beta=0.3), logps, counts, reference)
    ratios = logps - reference
    ipo = (ratios[0::2] / counts[0::2] - ratios[1::2] / counts[1::2] - 1 / 0.6) ** 2
    torch.testing.assert_close(terms.loss, ipo)
    assert loss.correct(logits, targets) == int(((logps - reference)[0::2] > (logps - reference)[1::2]).sum())

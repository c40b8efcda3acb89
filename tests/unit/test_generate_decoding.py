"""Decoding without processes: the next-token choice (greedy, temperature, top-p, seeded), stopping at EOS and at
the length, left padding, the prompts' context check and the bad input of `pipetrain generate`."""

from __future__ import annotations

import pytest
import torch

from pipetrain.cli import main as cli_main
from pipetrain.errors import ConfigError
from pipetrain.generate.prompts import check_context, left_pad, read_prompts
from pipetrain.generate.sampling import Sampling, Stopping, next_tokens

pytest.importorskip("transformers")


def test_greedy_is_the_argmax_per_row():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, -1.0, 4.9]])
    assert next_tokens(logits, Sampling(), torch.zeros(2, 1, dtype=torch.long)).tolist() == [1, 0]


def test_seeded_sampling_repeats_and_another_seed_differs():
    logits = torch.zeros(64, 50)
    seq = torch.zeros(64, 1, dtype=torch.long)
    draw = lambda seed: next_tokens(logits, Sampling(1.0, 1.0, seed), seq, Sampling(1.0, 1.0, seed).generator())
    assert torch.equal(draw(3), draw(3))
    assert not torch.equal(draw(3), draw(4))


def test_top_p_keeps_only_the_tokens_reaching_the_mass():
    # probabilities 0.6, 0.3, 0.1 (and ~0): top-p 0.8 keeps the first two only
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1, 1e-9]])).expand(2000, -1)
    sampling = Sampling(temperature=1.0, top_p=0.8, seed=0)
    chosen = next_tokens(logits, sampling, torch.zeros(2000, 1, dtype=torch.long), sampling.generator())
    counts = torch.bincount(chosen, minlength=4)
    assert counts[2] == 0 and counts[3] == 0
    assert 0.6 < counts[0] / 2000 < 0.73  # 0.6 / 0.9 renormalised


def test_a_low_temperature_sharpens_towards_the_argmax():
    logits = torch.tensor([[1.0, 1.5, 0.0]]).expand(500, -1)
    sampling = Sampling(temperature=0.05, seed=1)
    chosen = next_tokens(logits, sampling, torch.zeros(500, 1, dtype=torch.long), sampling.generator())
    assert (chosen == 1).all()


def test_stopping_pads_finished_rows_and_ends_when_all_finish():
    stop = Stopping(3, eos=[9], pad=0, max_new_tokens=10)
    assert not stop.update(stop.mask(torch.tensor([9, 4, 5])))  # row 0 ends
    assert stop.mask(torch.tensor([7, 9, 8])).tolist() == [0, 9, 8]
    assert not stop.update(stop.mask(torch.tensor([7, 9, 8])))  # row 1 ends
    assert stop.update(stop.mask(torch.tensor([1, 1, 9])))  # row 2 ends: all finished
    assert stop.steps == 3


def test_stopping_at_the_length_without_eos():
    stop = Stopping(2, eos=None, pad=None, max_new_tokens=2)
    assert not stop.update(torch.tensor([1, 2]))
    assert stop.update(torch.tensor([1, 2]))


def test_left_padding_with_mask_and_positions_as_generate():
    batch = left_pad([[5, 6, 7], [8]], pad=0)
    assert batch.ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert batch.mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert batch.positions.tolist() == [[0, 1, 2], [0, 0, 0]]
    assert batch.lengths == [3, 1]


def test_a_prompt_longer_than_the_context_names_the_lengths_and_the_fix():
    with pytest.raises(ConfigError) as err:
        check_context([5, 120], 16, 128)
    assert "prompt 2 is 120 tokens long" in str(err.value) and "context of 128 tokens" in str(err.value)
    assert "--max-new-tokens 8 or fewer" in str(err.value)
    with pytest.raises(ConfigError, match="shorten prompt 1 to under 128"):
        check_context([200], 1, 128)
    check_context([100, 3], 28, 128)  # fits exactly


@pytest.mark.parametrize("bad", [(-1.0, 1.0), (1.0, 0.0), (1.0, 1.5)])
def test_bad_sampling_values(bad):
    with pytest.raises(ConfigError):
        Sampling(*bad)


def test_prompts_need_exactly_one_source(tmp_path):
    with pytest.raises(ConfigError, match="exactly one of --prompt TEXT and --prompts FILE"):
        read_prompts(None, None)
    with pytest.raises(ConfigError, match="both were given"):
        read_prompts("hi", tmp_path / "p.txt")
    (tmp_path / "p.txt").write_text("one\n\n two \n")
    assert read_prompts(None, tmp_path / "p.txt") == ["one", "two"]


@pytest.mark.parametrize("argv, message", [
    (["--model", "M", "--checkpoint", "C", "--prompt", "x"], "exactly one of --model DIR and --checkpoint CK (both"),
    (["--prompt", "x"], "exactly one of --model DIR and --checkpoint CK"),
    (["--model", "MODEL"], "exactly one of --prompt TEXT and --prompts FILE"),
])
def test_generate_bad_input_is_one_line_and_exit_2(argv, message, tmp_path, capsys):
    from tests.hf_folders import tiny_model_folder

    folder = tiny_model_folder(tmp_path / "m", "llama", layers=2)
    argv = [str(folder) if arg == "MODEL" else arg for arg in argv]
    capsys.readouterr()  # saving the folder prints progress
    assert cli_main.main(["generate", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_generate_refuses_a_prompt_longer_than_the_context(tmp_path, capsys):
    from tests.hf_folders import tiny_model_folder

    folder = tiny_model_folder(tmp_path / "m", "gpt2", layers=2)  # 128 positions
    capsys.readouterr()
    assert cli_main.main(["generate", "--model", str(folder), "--prompt", "abc " * 200, "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert "longer than the model's context of 128 tokens" in err and "hint: shorten prompt 1" in err


def test_generate_prints_the_texts_on_stdout_and_the_figures_on_stderr(tmp_path, capfd):
    """A script reading the answer from standard output gets the text only (fails on main: the tokens/s line came
    after the text on standard output)."""
    from tests.hf_folders import tiny_model_folder

    tiny_model_folder(tmp_path / "llama", "llama")
    capfd.readouterr()
    assert cli_main.main(["generate", "--model", str(tmp_path / "llama"), "--prompt", "The cat", "--max-new-tokens",
                          "3", "--device", "cpu"]) == 0
    captured = capfd.readouterr()
    assert captured.out.startswith("[1] The cat\n--> ") and "tokens/s" not in captured.out
    assert "tokens (1 prompts x " in captured.err and "tokens/s at pp=1 tp=1" in captured.err


def test_generate_help_names_lora_checkpoints(capsys):
    """Fails on main: the help said a model folder or a full fine-tune's checkpoint, though LoRA ones work too."""
    with pytest.raises(SystemExit):
        cli_main.main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "full or LoRA" in text and "a LoRA one" in text and "standard error" in text

"""`--objective grpo` without processes: the reward functions called with TRL's signature and refused in one line
(the function and the row named), the flags checked (G dividing the batch, KL needing LoRA), and the surrogate's
clip, KL and normalisations on numbers worked by hand."""

from __future__ import annotations

import math

import pytest
import torch

from pipetrain.errors import ConfigError
from pipetrain.objectives import GRPOLossSettings, GRPOSettings, SurrogateLoss
from pipetrain.objectives.columns import with_columns
from pipetrain.objectives.grpo_loss import surrogate
from pipetrain.objectives.rewards import load_rewards, score
from pipetrain.objectives.prompt_rows import check_generations

REWARDS = '''
def exact(prompts, completions, answer, **kwargs):
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

def length(prompts, completions, completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]

def picky(prompts, completions, answer, **kwargs):
    if "7" in answer:
        raise ValueError("no sevens")
    return [0.0] * len(prompts)

def short(prompts, completions, **kwargs):
    return [1.0]

def unsure(prompts, completions, **kwargs):
    return [None] * len(prompts)

def noisy(prompts, completions, **kwargs):
    raise ValueError("first line\\nsecond line")

def lost(prompts, completions, **kwargs):
    return [0.5, float("nan")]

def wordy(prompts, completions, **kwargs):
    return [1.0, "1.0"]
'''


@pytest.fixture()
def rewards(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS)
    return lambda name: f"{path}:{name}"


def test_rewards_get_trls_arguments_and_add_up(rewards):
    functions = load_rewards([rewards("exact"), rewards("length")])
    per, total = score(functions, ["1+1=", "1+2="], [" 2", "4"], [[5, 6], [7]], {"answer": ["2", "3"]}, [10, 11])
    assert per.tolist() == [[1.0, 2.0], [0.0, 1.0]] and total.tolist() == [3.0, 1.0]
    _, unscored = score(load_rewards([rewards("unsure")]), ["a"], ["b"], [[1]], {}, [0])
    assert math.isnan(unscored[0])


@pytest.mark.parametrize("name, says", [
    ("picky", "--reward '{}': picky raised ValueError: no sevens on row 13"),
    ("short", "--reward '{}': short returned 1 reward(s) for 2 completions (rows 12..13)"),
    ("missing", "--reward '{}': "),
    ("noisy", "--reward '{}': noisy raised ValueError: first line on row 12"),
    ("lost", "--reward '{}': lost returned nan for row 13"),
    ("wordy", "--reward '{}': wordy returned str '1.0' for row 13, not a number"),
])
def test_a_bad_reward_function_is_named_with_its_row(rewards, name, says):
    """Data rows 11 and 12 (from 0) are rows 12 and 13 as an editor numbers lines (main said 11 and 12)."""
    with pytest.raises(ConfigError) as err:
        functions = load_rewards([rewards(name)])
        score(functions, ["p", "q"], ["a", "b"], [[1], [2]], {"answer": ["3", "7"]}, [11, 12])
    assert err.value.message.startswith(says.format(rewards(name))) and "\n" not in err.value.message


def test_a_bad_prompt_is_named_by_its_line(tmp_path, monkeypatch):
    """The row that is not text is line 3 of the file, and the message says row 3 (main: row 2)."""
    pytest.importorskip("datasets")
    import json

    from pipetrain.data import cache as data_cache
    from pipetrain.errors import DataError
    from pipetrain.objectives.prompt_rows import read_prompt_rows
    from tests.hf_folders import tiny_tokenizer

    monkeypatch.setattr(data_cache, "default_cache_root", lambda: tmp_path / "cache")
    rows = [{"prompt": f"{i} plus 1 is", "answer": str(i + 1)} for i in range(12)]
    rows[2]["prompt"] = 5
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    settings = GRPOSettings(rewards=("r.py:f",), generations=2)
    with pytest.raises(DataError) as err:
        read_prompt_rows(data, tiny_tokenizer(), seq_len=64, settings=settings)
    assert err.value.message.startswith(f"row 3 of --data {str(data)!r}: 'prompt' is int 5"), err.value.message


def test_a_chat_prompt_with_a_role_the_template_does_not_know_is_refused():
    """Fails on main: the misspelled role was rendered (or dropped) by the template without a word."""
    from pipetrain.errors import DataError
    from pipetrain.objectives.prompt_rows import _encode
    from tests.hf_folders import chat_tokenizer

    with pytest.raises(DataError) as err:
        _encode(chat_tokenizer(), [{"role": "usr", "content": "1 plus 1?"}], 0, "t")
    assert err.value.message.startswith("row 1 of t has the role(s) 'usr', which the chat template does not know")


def test_g_must_divide_the_batch_and_its_prompts_the_replicas():
    with pytest.raises(ConfigError, match="--num-generations 3 does not divide --batch-size 8"):
        check_generations(8, 3, 1)
    with pytest.raises(ConfigError, match="which 2 replicas do not share evenly"):
        check_generations(12, 4, 2)
    check_generations(16, 4, 2)
    with pytest.raises(ConfigError, match="needs a reward function"):
        GRPOSettings()


def test_kl_needs_the_lora_base_as_its_reference(tmp_path):
    from pipetrain.train.config import TrainConfig
    from tests.hf_folders import tiny_model_folder

    folder = tiny_model_folder(tmp_path / "m")
    settings = GRPOSettings(rewards=("r.py:f",), generations=2, loss=GRPOLossSettings(kl_beta=0.1))
    with pytest.raises(ConfigError, match="--kl-beta 0.1 needs a reference model"):
        TrainConfig(workload="hf", model_dir=folder, data=tmp_path, batch_size=4, objective=settings)


def test_the_surrogate_clips_and_adds_the_bias_corrected_kl():
    settings = GRPOLossSettings(epsilon=0.2, kl_beta=0.5)
    logps = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    old = torch.tensor([[-1.5, float("nan")]], dtype=torch.float64)  # NaN: the current log-prob (ratio 1)
    ref = torch.tensor([[-1.2, -2.0]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.float64)
    loss, kl, clipped = surrogate(settings, logps, mask, old, ref, torch.tensor([2.0]))
    ratio = math.exp(0.5)  # above 1.2 with a positive advantage: clipped
    kl0 = math.exp(-0.2) + 0.2 - 1
    assert clipped.tolist() == [[1.0, 0.0]]
    assert loss[0, 0].item() == pytest.approx(-1.2 * 2 + 0.5 * kl0 * ratio)
    assert loss[0, 1].item() == pytest.approx(-2.0) and kl[0, 1].item() == 0.0


# per token: -advantage (ratio 1); grpo sums each completion's token mean (1 + 1.5), dapo every token (1 + 1.5 + 1.5)
@pytest.mark.parametrize("kind, expected", [("grpo", 2.5), ("dapo", 4.0)])
def test_grpo_counts_completions_and_dapo_tokens(kind, expected):
    loss = SurrogateLoss(GRPOLossSettings(loss=kind))
    logits = torch.zeros(2, 2, 3, dtype=torch.float64)  # every token has probability 1/3
    labels = torch.tensor([[1, -100], [2, 0]])
    columns = torch.full((2, 5), float("nan"), dtype=torch.float64)
    columns[:, 4] = torch.tensor([-1.0, -1.5])  # advantages; old log-probs NaN: ratio 1
    targets = with_columns(labels, columns)
    assert loss.count(targets) == (2 if kind == "grpo" else 3)
    assert loss.total(logits, targets).item() == pytest.approx(expected)

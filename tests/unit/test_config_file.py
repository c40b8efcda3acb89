"""Config files: `--print-config` output read back by `--config` unchanged, flags over file values, file values
reaching `TrainConfig`, and the file format over any argparse parser (flags other verbs or engineers add)."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import pytest

from pipetrain.cli.train_args import describe  # was the private cli.train._config
from pipetrain.cli.config_file import add_config_arguments, apply_config_file, load_config
from pipetrain.cli.main import build_parser, main
from pipetrain.errors import ConfigError

TINY = ["train", "--preset", "tiny", "--data", "synthetic", "--train-samples", "64", "--test-samples", "32", "--epochs", "1"]


def _print(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    assert main(argv + ["--print-config"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    return out


def _args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser(argv)
    return apply_config_file(parser, argv, parser.parse_args(argv))


def test_print_config_is_read_back_unchanged(capsys, tmp_path):
    first = _print(capsys, TINY + ["--balance", "2,4", "--bucket", "--eval-every", "7", "--save-dir", str(tmp_path),
                                   "--lr", "3e-4", "--schedule", "gpipe"])
    assert "balance = [\n    2,\n    4,\n]" in first  # tomli-w writes one element per line
    assert "[parallelism]" in first and "[logs]" in first and "eval-every = 7" in first
    path = tmp_path / "run.toml"
    path.write_text(first)
    second = _print(capsys, ["train", "--config", str(path)])
    assert second == first
    path.write_text(second)
    assert _print(capsys, ["train", "--config", str(path)]) == first


@pytest.mark.parametrize("flags", [["--resume", "--keep", "all"], ["--keep", "5"], ["--resume", "{ckpt}"]])
def test_flags_of_their_own_types_round_trip(flags, capsys, tmp_path):
    """--resume alone or with a checkpoint (nargs="?"), --keep K|all (a type reading numbers and words)."""
    (tmp_path / "step-00000004").mkdir()
    flags = [f.replace("{ckpt}", str(tmp_path / "step-00000004")) for f in flags]
    first = _print(capsys, TINY + ["--save-dir", str(tmp_path), *flags])
    path = tmp_path / "run.toml"
    path.write_text(first)
    assert _print(capsys, ["train", "--config", str(path)]) == first
    durable = describe(_args(["train", "--config", str(path)])).durable
    expected = describe(_args(TINY + ["--save-dir", str(tmp_path), *flags])).durable
    assert durable == expected


def test_file_values_reach_train_config_and_flags_win(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("""
[parallelism]
pp = 2
n_microbatches = 2        # an alias, with an underscore
balance = [2, 4]

[training]
preset = "tiny"
batch-size = 32
epochs = 3
lr = 1                    # an integer for a float flag
bucket = true
data = "synthetic"
train-samples = 64

[logs]
eval-every = 5
eval-batches = 2
run-dir = "somewhere"

[checkpoints-and-failures]
step-timeout = 60
""")
    config = describe(_args(["train", "--config", str(path), "--epochs", "1", "--eval-every", "9"]))
    assert config.parallel.pipeline.n_microbatches == 2 and config.parallel.pipeline.balance == (2, 4)
    assert (config.preset, config.batch_size, config.lr, config.bucket, config.train_samples) == ("tiny", 32, 1.0, True, 64)
    assert config.epochs == 1  # the flag wins over the file's 3
    assert (config.logs.eval_every, config.logs.eval_batches, config.logs.run_dir) == (9, 2, Path("somewhere"))
    assert config.durable.step_timeout_s == 60.0
    assert 'batch-size = 32' in config.logs.config_text and "epochs = 1" in config.logs.config_text
    assert config.as_json()["logs"]["config_text"] == config.logs.config_text  # what checkpoints record


def test_defaults_come_back_without_a_file():
    args = _args(["train"])
    assert (args.batch_size, args.pp, args.eval_every) == (64, 2, None)
    assert args.effective_config.startswith("# pipetrain train: effective configuration")


def _parser() -> argparse.ArgumentParser:
    """A verb as another engineer might write it: groups, a boolean pair, choices, a list flag."""
    top = argparse.ArgumentParser(prog="tool")
    sub = top.add_subparsers(dest="verb")
    verb = sub.add_parser("fit")
    recipe = verb.add_argument_group("recipe")
    recipe.add_argument("--lr-schedule", choices=["constant", "cosine"], default="constant")
    recipe.add_argument("--warmup-steps", type=int, default=0)
    recipe.add_argument("--grad-clip", type=float, default=None)
    recipe.add_argument("--skip-nonfinite", action=argparse.BooleanOptionalAction, default=True)
    recipe.add_argument("--layers", type=int, nargs="+", default=[1])
    verb.add_argument("--quiet", action="store_false", dest="loud")
    add_config_arguments(verb)
    return top


def test_any_parser(tmp_path):
    path = tmp_path / "fit.toml"
    path.write_text('quiet = true\n[recipe]\nlr-schedule = "cosine"\nwarmup_steps = 10\nskip-nonfinite = false\n'
                    "layers = [2, 3]\ngrad-clip = 1\n")
    top = _parser()
    argv = ["fit", "--config", str(path), "--warmup-steps", "20"]
    args = apply_config_file(top, argv, top.parse_args(argv))
    assert (args.lr_schedule, args.warmup_steps, args.skip_nonfinite, args.layers, args.grad_clip, args.loud) == (
        "cosine", 20, False, [2, 3], 1.0, False)
    path.write_text(args.effective_config)
    again = apply_config_file(top := _parser(), ["fit", "--config", str(path)], top.parse_args(["fit", "--config", str(path)]))
    same = {"config": None, "config_parser": None}  # the file's path, and a parser made anew
    assert vars(again) | same == vars(args) | same
    assert again.effective_config == args.effective_config


@pytest.mark.parametrize("text, message", [
    ("[recipe]\nwarmup-step = 3\n", "unknown key '[recipe] warmup-step' (hint: did you mean 'warmup-steps'?)"),
    ("[recipes]\nwarmup-steps = 3\n", "unknown section [recipes] (hint: did you mean 'recipe'?)"),
    ('warmup-steps = "3"\n', "warmup-steps = '3' is not an integer"),
    ("warmup-steps = 2.5\n", "warmup-steps = 2.5 is not an integer"),
    ("warmup-steps = true\n", "warmup-steps = True is not an integer"),
    ('grad-clip = "big"\n', "grad-clip = 'big' is not a number"),
    ('skip-nonfinite = "yes"\n', "skip-nonfinite = 'yes' is not true or false"),
    ('lr-schedule = "linear"\n', "lr-schedule = 'linear' is not one of ['constant', 'cosine']"),
    ("layers = 3\n", "layers = 3 is not an array"),
    ("warmup-steps = 1\nwarmup_steps = 2\n", "'warmup_steps' sets warmup-steps, already set by 'warmup-steps'"),
    ("config = 'x.toml'\n", "unknown key 'config'"),
    ("warmup-steps = \n", "is not valid TOML"),
    ("[recipe.sub]\nx = 1\n", "[recipe] sub is a table"),
])
def test_bad_files(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_config(path, _parser()._subparsers._group_actions[0].choices["fit"])
    assert message in str(caught.value) and "\n" not in str(caught.value)
    assert str(path) in str(caught.value)


@pytest.mark.parametrize(("data", "expected"), [([], ["bucket = true", "seq-len = 160", "epochs = 1"]),
                                                (["--data", "synthetic"], ["bucket = false", "seq-len = 64",
                                                                           "epochs = 2"])])
def test_defaults_that_depend_on_the_data_are_printed_resolved(data, expected, capsys):
    printed = _print(capsys, ["train", *data])
    assert all(line in printed.splitlines() for line in expected), printed


@pytest.mark.parametrize("flags,schedule,warmup,clip", [
    ([], "cosine", 30, 1.0),  # make train's job: the classifier on real reviews takes its workload's recipe
    (["--data", "synthetic"], "constant", 0, None),  # the synthetic corpus: RecipeConfig's defaults
    (["--lr-schedule", "constant"], "constant", 30, 1.0),  # a flag given decides its field, the others stay open
    (["--warmup-steps", "5", "--grad-clip", "none"], "cosine", 5, None),
    (["--grad-clip", "0.5"], "cosine", 30, 0.5),
    (["--workload", "lm"], "constant", 0, None),  # a workload without a recipe of its own
    (["--max-steps", "40"], "cosine", 4, 1.0),  # a short run warms up over its first tenth at most
    (["--max-steps", "2"], "cosine", 0, 1.0),
])
def test_recipe_flags_left_open_take_the_workloads_values_for_its_data(flags, schedule, warmup, clip):
    args = _args(["train", *flags])
    config = describe(args)
    assert (config.recipe.lr_schedule, config.recipe.warmup_steps, config.recipe.grad_clip) == (schedule, warmup, clip)
    written = config.logs.config_text
    assert f'lr-schedule = "{schedule}"' in written and f"warmup-steps = {warmup}" in written
    assert (clip is None and "grad-clip" not in written.replace('grad-clip = "none"', "")) or f"grad-clip = {clip}" in written
    assert describe(_args(["train", "--config", _written(written)])).recipe == config.recipe  # read back the same


def _written(text: str) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as handle:
        handle.write(text)
    return handle.name

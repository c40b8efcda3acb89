"""`pipetrain plan` with tensor parallelism: --tp in the ready command lines, TP inside a node, one message per bad tp."""

from __future__ import annotations

import argparse
import shlex

import pytest

import pipetrain.cli.plan as plan_cli
import pipetrain.cli.plan_space as plan_space
from pipetrain.cli.main import build_parser, main
from pipetrain.partition.profile import BlockProfile, ModelProfile, save_profile

GPU = ["--preset", "gpu", "--gpu-mem", "80", "--batch", "128", "--top", "5"]


def _plan(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def _line(out: str, verb: str) -> list[str]:
    return shlex.split(next(line for line in out.splitlines() if line.strip().startswith(f"pipetrain {verb}")))


def _rows(out: str) -> list[list[str]]:
    """The table's rows (rank, dp, pp, tp, schedule, ...)."""
    return [row.split() for row in out.splitlines() if row[:3].strip().isdigit() and len(row.split()) > 10]


def _train_has_tp() -> bool:
    verbs = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return "--tp" in verbs.choices["train"]._option_string_actions


def test_tp_rendered_into_train_and_sbatch_lines(capsys, tmp_path):
    code, out, err = _plan(capsys, "--nodes", "2", "--gpus-per-node", "4", "--tp", "2", "--sequence-parallel", "on",
                           *GPU)
    assert code == 0, err
    header = next(line for line in out.splitlines() if "schedule" in line and "step s" in line)
    assert header.split()[:4] == ["#", "dp", "pp", "tp"]
    rows = _rows(out)
    assert rows and all(row[3] == "2sp" for row in rows)
    train, sbatch = _line(out, "train"), _line(out, "sbatch")
    assert train[train.index("--tp") + 1] == "2" and "--sequence-parallel" in train
    assert sbatch[sbatch.index("--tp") + 1] == "2"
    dp, pp = int(train[train.index("--dp") + 1]), int(train[train.index("--pp") + 1])
    assert dp * pp * 2 == 8
    if _train_has_tp():  # once the engine's --tp is merged, the lines must parse
        args = build_parser().parse_args(train[1:])
        assert args.dp * args.pp * args.tp == 8
        build_parser().parse_args(sbatch[1:])


def test_every_tp_of_a_node_searched_when_the_engine_has_it(capsys, monkeypatch):
    for module in (plan_cli, plan_space):  # the search and the printed lines
        monkeypatch.setattr(module, "engine_has", lambda axis: True)
    # ddp and fsdp only: across two nodes HSDP's tp-1 layouts would fill the top 40 (test_plan_hsdp_search.py)
    code, out, err = _plan(capsys, "--nodes", "2", "--gpus-per-node", "4", "--dp-modes", "ddp,fsdp", *GPU[:-1], "40")
    assert code == 0, err
    tps = {int(row[3].removesuffix("sp")) for row in _rows(out)}
    assert tps and tps <= {1, 2, 4} and len(tps) > 1  # never 8: a TP group stays on its node of 4


def test_without_engine_tp_the_plan_says_so(capsys, monkeypatch):
    for module in (plan_cli, plan_space):  # the search and the printed lines
        monkeypatch.setattr(module, "engine_has", lambda axis: False)
    code, out, err = _plan(capsys, "--gpus", "8", *GPU)
    assert code == 0, err
    assert "tensor parallelism not considered" in out and "--tp" not in " ".join(_line(out, "train"))


def _profile(tmp_path):
    blocks = tuple(BlockProfile(index=i, name=f"Block{i}", forward_s=0.01, backward_s=0.02, param_bytes=4000,
                                activation_bytes=16000, output_bytes=4096) for i in range(4))
    path = tmp_path / "profile.json"
    save_profile(ModelProfile(model="classifier:tiny", fingerprint="0" * 64, micro_batch_size=8, device="cpu",
                              dtype="float32", repeats=3, blocks=blocks), path)
    return str(path)


@pytest.mark.parametrize("argv,needle", [
    (["--nodes", "2", "--gpus-per-node", "4", "--tp", "8", *GPU], "--tp 8 would put a tensor-parallel group across "
                                                                  "nodes of 4 GPUs"),
    (["--gpus", "8", "--tp", "3", *GPU], "--tp 3 would put a tensor-parallel group across nodes"),
    (["--gpus", "6", "--gpus-per-node", "6", "--tp", "6", *GPU], "--tp 6: tp=6 does not divide nhead=16"),
    (["--gpus", "4", "--tp", "4", "--preset", "cpu"], "tp=4 does not divide nhead=2"),
    (["--gpus", "4", "--tp", "2", "--sequence-parallel", "on", "--preset", "gpu", "--batch", "64"], None),
    (["--gpus", "4", "--tp", "0", "--preset", "cpu"], "--tp must be positive"),
])
def test_bad_tp_one_clear_message(capsys, argv, needle):
    code, out, err = _plan(capsys, *argv)
    if needle is None:
        assert code == 0, err
        return
    assert code == 2 and needle in err and err.count("pipetrain: error") == 1 and "Traceback" not in err


def test_a_profile_has_no_tp_plan(capsys, tmp_path):
    code, _, err = _plan(capsys, "--gpus", "2", "--tp", "2", "--profile", _profile(tmp_path), "--batch", "32")
    assert code == 2 and "no tensor-parallel plan" in err and "--preset" in err


def test_tune_refuses_tp(capsys):
    code = main(["tune", "--gpus", "2", "--preset", "cpu", "--batch", "32", "--tp", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "tp=1, not --tp 2" in err and err.count("pipetrain: error") == 1


def test_profile_refuses_tp_with_the_reason(capsys, tmp_path):
    code = main(["profile", "--preset", "tiny", "--tp", "2", "--output", str(tmp_path / "p.json")])
    err = capsys.readouterr().err
    assert code == 2 and "profile --tp 2" in err and "unsplit block" in err and err.count("pipetrain: error") == 1
    assert not (tmp_path / "p.json").exists()

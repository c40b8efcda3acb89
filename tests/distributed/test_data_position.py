"""A data position that survives any layout change, and `--max-steps` as the run's length (real `pipetrain train`
jobs of the `lm` workload on a small text written here, CPU/gloo).

The reference job trains `--max-steps 30` at dp=2 (three epochs of 10 batches: 76 documents, global batch 8, the
last batch of each epoch 4 documents) on a cosine schedule whose length is those 30 steps, saving every 4 steps.
Its step-4 checkpoint is resumed at dp=1 × pp=2, whose step-12 checkpoint (inside epoch 2) is resumed at dp=4:
every resumed step trains the same samples as the reference's (the same token counts, asserted exactly) with its
loss within 1e-5 (the micro-batches are cut differently: the sums run in another order); the step-8 checkpoint
resumed at the reference's own layout gives its losses bitwise.
"""

from __future__ import annotations

import json
import random
import shutil
from importlib.util import find_spec
from pathlib import Path

import pytest

from pipetrain.cli.main import main
from pipetrain.launch.env import DEVICE_VARIABLE
from pipetrain.logs.jsonl import read_records
from pipetrain.recipe.config import RecipeConfig
from pipetrain.recipe.schedule import lr_at

RTOL = 1e-5
STEPS, PER_EPOCH = 30, 10
WORDS = ("the a cat dog sat on mat ran far away house tree river blue green red small big old new quick slow light "
         "dark").split()


def _documents() -> list[str]:
    """84 documents of 8 to 40 words (76 train documents, 8 held out)."""
    pick = random.Random(0)
    return [" ".join(pick.choice(WORDS) for _ in range(pick.randint(8, 40))) for _ in range(84)]


def _text(folder: Path) -> Path:
    """The documents as paragraphs of a text file."""
    path = folder / "corpus.txt"
    path.write_text("\n\n".join(_documents()))
    return path


def _json_lines(folder: Path) -> Path:
    """The documents as `{"text": ...}` rows of a JSON lines file."""
    path = folder / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": document}) + "\n" for document in _documents()))
    return path


#: the data the jobs train on, written into a folder: JSON lines rows where pipetrain reads them (its `data`
#: room, read through `datasets`), else the same documents as a text file
DATA = _json_lines if find_spec("pipetrain.data") and find_spec("datasets") else _text
ARGS = ["--workload", "lm", "--preset", "tiny", "--batch-size", "8", "--max-steps", str(STEPS), "--lr-schedule",
        "cosine", "--warmup-steps", "3", "--no-progress", "--log-every", "100"]
DP2 = ["--dp", "2", "--pp", "1", "--chunks", "2"]


def _train(folder: Path, data: Path, name: str, *extra: str) -> list[dict]:
    """`pipetrain train` in this process (its ranks are spawned); the step records of its run folder."""
    code = main(["train", *ARGS, "--data", str(data), "--run-dir", str(folder / name), "--save-dir",
                 str(folder / f"{name}-ckpt"), "--save-every", "4", "--keep", "all", *extra])
    assert code == 0
    return read_records(folder / name / "steps.jsonl", "step")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, Path, list[dict]]:
    folder = tmp_path_factory.mktemp("position")
    with pytest.MonkeyPatch.context() as patch:  # the module's fixture runs before conftest's per-test pin
        patch.setenv(DEVICE_VARIABLE, "cpu")
        data = DATA(folder)
        steps = _train(folder, data, "ref", *DP2)
    return folder, data, steps


def _checkpoint(folder: Path, name: str, step: int) -> str:
    return str(folder / f"{name}-ckpt" / f"step-{step:08d}")


def _same_samples(got: list[dict], want: list[dict], first: int, *, bitwise: bool) -> None:
    assert [r["step"] for r in got] == list(range(first, STEPS + 1))
    for mine, theirs in zip(got, want[first - 1 :], strict=True):
        assert (mine["epoch"], mine["samples"], mine["tokens"]) == (theirs["epoch"], theirs["samples"],
                                                                    theirs["tokens"]), mine["step"]
        assert mine["lr"] == theirs["lr"]
        if bitwise:
            assert mine["loss"] == theirs["loss"], mine["step"]
        else:
            assert mine["loss"] == pytest.approx(theirs["loss"], rel=RTOL), mine["step"]


def test_max_steps_is_the_run_length_going_round_the_data(reference):
    _, _, steps = reference
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert [r["epoch"] for r in steps] == [1] * PER_EPOCH + [2] * PER_EPOCH + [3] * PER_EPOCH
    schedule = RecipeConfig(lr_schedule="cosine", warmup_steps=3)
    assert [r["lr"] for r in steps] == pytest.approx([lr_at(schedule, s, STEPS) for s in range(STEPS)], rel=1e-12)


def test_resume_under_dp1_pp2_then_dp4_trains_the_same_samples(reference, tmp_path, capfd):
    folder, data, steps = reference
    dp1 = _train(tmp_path, data, "dp1", "--dp", "1", "--pp", "2", "--chunks", "2", "--resume",
                 _checkpoint(folder, "ref", 4))
    _same_samples(dp1, steps, 5, bitwise=False)
    # step 12: inside epoch 2, two batches of it done; the dp=4 job seeks to global sample 16 of its order
    dp4 = _train(tmp_path, data, "dp4", "--dp", "4", "--pp", "1", "--chunks", "1", "--resume",
                 _checkpoint(tmp_path, "dp1", 12))
    _same_samples(dp4, steps, 13, bitwise=False)
    out = capfd.readouterr().out
    assert out.count("resumed from") == 2 and "another recipe" not in out, out  # a layout is not the recipe


def test_resume_under_the_same_layout_is_bitwise(reference, tmp_path, capfd):
    """...and a recipe field changed on resume (one that changes no loss here) is said in one line by rank 0."""
    folder, data, steps = reference
    _same_samples(_train(tmp_path, data, "again", *DP2, "--resume", _checkpoint(folder, "ref", 8),
                         "--skip-nonfinite", "2"), steps, 9, bitwise=True)
    warned = [line for line in capfd.readouterr().out.splitlines() if "another recipe" in line]
    assert len(warned) == 1 and "--skip-nonfinite 0 -> 2" in warned[0] and "--lr" not in warned[0], warned


def test_a_checkpoint_inside_an_epoch_needs_its_global_batch(reference, tmp_path, capsys):
    folder, data, _ = reference
    shutil.copytree(_checkpoint(folder, "ref", 4), tmp_path / "ckpt" / "step-00000004")
    code = main(["train", *ARGS, "--data", str(data), "--save-dir", str(tmp_path / "ckpt"), "--resume",
                 "--batch-size", "16"])
    assert code == 2
    err = capsys.readouterr().err
    assert "global batch size 8, this job's is 16" in err and "--batch-size 8" in err, err


def test_a_resume_on_changed_data_is_refused_in_one_line(reference, tmp_path, capsys):
    """Rows appended to the data shift every epoch's order: the saved position would skip or repeat samples (main
    resumed without a word)."""
    folder, data, _ = reference
    shutil.copytree(_checkpoint(folder, "ref", 4), tmp_path / "ckpt" / "step-00000004")
    changed = tmp_path / data.name
    changed.write_text(data.read_text() + data.read_text().split("\n", 1)[0] + "\n")
    capsys.readouterr()
    code = main(["train", *ARGS, *DP2, "--data", str(changed), "--save-dir", str(tmp_path / "ckpt"), "--resume"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert f"--data {str(changed)!r} is not the data checkpoint" in err and "its content or fields changed" in err
    assert "resume with the data the run trained on" in err

"""`--workload MODULE:NAME` and `path/to/file.py:NAME`: every accepted form, and one message per bad input."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from pipetrain.cli.main import main
from pipetrain.errors import ConfigError
from pipetrain.train.loop import TrainConfig
from pipetrain.workloads.loader import load_workload, portable, workload_label
from pipetrain.workloads.registry import Workload, get_workload

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = f"{ROOT / 'examples' / 'my_model.py'}:workload"


def test_a_file_path_names_an_instance_loaded_once_per_process():
    first, again = get_workload(EXAMPLE), get_workload(EXAMPLE)
    assert first.name == "spiral" and first is again  # the module is loaded once: the same object
    config = TrainConfig(workload=EXAMPLE, preset="tiny", data="synthetic", train_samples=16, test_samples=8,
                         batch_size=8)
    assert config.model().num_blocks == 6 and config.model_name() == f"{EXAMPLE}:tiny"
    assert workload_label(EXAMPLE) == "workload" and workload_label("lm") == "lm"


def test_a_module_path_and_a_subclass_and_a_factory(tmp_path):
    assert get_workload("tests.distributed.check_models:counter").name == "toy"
    assert type(get_workload("pipetrain.workloads.lm.workload:LanguageModelWorkload")).__name__ == \
        "LanguageModelWorkload"  # a subclass is instantiated
    (tmp_path / "factory.py").write_text(
        "from pipetrain.workloads.lm.workload import LanguageModelWorkload\n"
        "def make():\n    return LanguageModelWorkload()\n")
    assert isinstance(load_workload(f"{tmp_path / 'factory.py'}:make"), Workload)


def test_a_file_imports_the_modules_beside_it(tmp_path):
    (tmp_path / "helpers_beside.py").write_text(
        "from pipetrain.workloads.lm.workload import LanguageModelWorkload\nBASE = LanguageModelWorkload\n")
    (tmp_path / "uses_helpers.py").write_text("from helpers_beside import BASE\nworkload = BASE()\n")
    assert isinstance(load_workload(f"{tmp_path / 'uses_helpers.py'}:workload"), Workload)


def test_data_of_a_files_own_type_crosses_to_a_rank_pickled():
    workload = get_workload(EXAMPLE)
    train, _ = workload.load_data(_request())
    back = pickle.loads(pickle.dumps(portable(EXAMPLE, train)))
    assert type(back) is type(train) and back.points.equal(train.points)
    assert portable("lm", train) is train


def _request():
    from pipetrain.workloads.registry import DataRequest

    return DataRequest(preset="tiny", path=None, synthetic=True, train_samples=8, test_samples=4, seed=0)


BAD = {
    "no-file": ("missing/model.py:workload", "no such file 'missing/model.py'"),
    "no-module": ("no_such_pkg.models:workload", "cannot import 'no_such_pkg.models': no module named 'no_such_pkg'"),
    "no-name": ("tests.distributed.check_models:nope", "has no 'nope'"),
    "not-a-workload": ("tests.distributed.check_models:not_a_workload", "is an int, not a workload"),
    "a-class-not-a-workload": ("pipetrain.errors:ConfigError", "the class ConfigError, not a Workload subclass"),
    "not-a-spec": ("examples/my_model.py:", "is not MODULE:NAME or path/to/file.py:NAME"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_one_message_each(case):
    spec, message = BAD[case]
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        get_workload(spec)


def test_a_missing_name_lists_the_workloads_found():
    with pytest.raises(ConfigError) as err:
        get_workload("tests.distributed.check_models:nope")
    assert "batch_stat" in err.value.hint and "counter" in err.value.hint


def test_a_file_that_fails_to_import_says_why(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import math\nraise ImportError('needs a GPU library')\n")
    with pytest.raises(ConfigError, match=r"importing .*broken.py' failed \(line 2\): ImportError: needs a GPU"):
        get_workload(f"{broken}:workload")
    (tmp_path / "needs.py").write_text("import no_such_dependency\n")
    with pytest.raises(ConfigError, match="No module named 'no_such_dependency'"):
        get_workload(f"{tmp_path / 'needs.py'}:workload")


def test_the_cli_prints_one_line_and_exits_2(capsys):
    assert main(["train", "--workload", "missing/model.py:workload", "--preset", "tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such file 'missing/model.py'" in err[0] and "hint:" in err[0]


def test_profile_and_plan_take_a_file_workload(capsys, tmp_path):
    profile = tmp_path / "profile.json"
    assert main(["profile", "--workload", EXAMPLE, "--preset", "tiny", "--micro-batch-size", "4", "--repeats", "1",
                 "--output", str(profile)]) == 0
    assert main(["plan", "--gpus", "2", "--profile", str(profile), "--batch", "16"]) == 0
    out = capsys.readouterr().out
    assert f"--workload {EXAMPLE} --preset tiny" in out


def test_a_bench_cell_reads_a_file_workload_before_its_preset():
    from pipetrain.bench.cell import cell_workload
    from pipetrain.bench.grid import Cell, parse_axis

    workload, preset = cell_workload(Cell(batch_size=8, preset=f"{EXAMPLE}:tiny"))
    assert (workload.name, preset) == ("spiral", "tiny")
    assert parse_axis(f"preset={EXAMPLE}:tiny") == ("preset", [f"{EXAMPLE}:tiny"])


def test_what_is_not_a_workload_is_named_with_its_article(tmp_path):
    (tmp_path / "bad.py").write_text("def make():\n    return 'text'\n\ndef odd():\n    return 3\n")
    with pytest.raises(ConfigError, match="is a factory returning a str, not a workload"):
        load_workload(f"{tmp_path / 'bad.py'}:make")
    with pytest.raises(ConfigError, match="is a factory returning an int, not a workload"):
        load_workload(f"{tmp_path / 'bad.py'}:odd")

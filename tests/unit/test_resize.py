"""`--on-resize`: a job resuming a checkpoint written by another number of ranks, decided without processes.

The pure decision (`plan.resize.decide`) on the fixture profile and calibration (no measuring): the new world's
layout and its one line, the flags given as constraints, the smallest world when none fits, a checkpoint of another
model, `stop`. Then the same through `prepare` for a launched rank (a torchrun restart's variables given as a
`ClusterEnv`, a checkpoint's metadata written by hand), `--resume auto`, and the CLI's one message for flags that fix
the world."""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path

import pytest

from pipetrain.checkpoint.folders import CheckpointMeta, final_folder, write_meta
from pipetrain.checkpoint.keys import fingerprint
from pipetrain.cli import main as cli_main
from pipetrain.cli.durable_args import durable_config
from pipetrain.cli.main import build_parser
from pipetrain.cli.train_args import describe
from pipetrain.errors import ConfigError
from pipetrain.launch.env import shared_store_restarts
from pipetrain.launch.ranks import ClusterEnv
from pipetrain.partition.profile import load_profile
from pipetrain.plan.auto import Fixed, choose_layout
from pipetrain.plan.hardware import load_calibration
from pipetrain.plan.model import profile_blocks
from pipetrain.plan.predict import Layout, predict
from pipetrain.plan.search import enumerate_layouts
from pipetrain.plan.resize import Saved, check_fixed_world, decide, describe_layout
from pipetrain.train.prepare import prepare

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
PROFILE, CALIBRATION = FIXTURES / "tiny-profile.json", FIXTURES / "cpu-calibration.json"
BLOCKS = profile_blocks(load_profile(PROFILE))
CALIB = load_calibration(CALIBRATION)
MODEL, PRINT = "classifier:tiny", "f" * 64
#: A dp2 x pp2 checkpoint's metadata as `save_checkpoint` writes it (the engine's record, the job's parallel config).
LAYOUT = {"world_size": 4, "dp": 2, "pp": 2, "schedule": "gpipe", "virtual_stages": 1, "balance": [3, 3],
          "stage_module": "Sequential"}
CONFIG = {"batch_size": 16, "parallel": {"dp": 2, "dp_mode": "ddp",
                                         "pipeline": {"pp": 2, "n_microbatches": 2, "checkpoint": "never"}}}


def _saved(model: str = MODEL, print_: str = PRINT) -> Saved:
    return Saved.from_meta("/ckpt/step-00000012", step=12, model=model, fingerprint=print_, layout=LAYOUT,
                           config=CONFIG, world_size=4)


def _chooser(fixed: Fixed, memory_mb: float | None = None):
    device = CALIB.device if memory_mb is None else replace(CALIB.device, memory_bytes=memory_mb * 2**20)
    return lambda world: choose_layout(BLOCKS, world=world, batch=16, device=device, network=CALIB.network,
                                       fixed=fixed).prediction


def _price(layout: Layout) -> float:
    return predict(BLOCKS, replace(layout, batch=16), CALIB.device, CALIB.network).step_s


def test_a_smaller_world_gets_the_planners_layout_and_one_line():
    saved = _saved()
    assert saved.layout == Layout(dp=2, pp=2, batch=16, chunks=2, schedule="gpipe")
    fixed = Fixed(pp=2)
    resize = decide(saved, world=2, policy="auto", model=MODEL, fingerprint=PRINT, choose=_chooser(fixed),
                    price=_price, fixed=fixed)
    assert resize is not None and resize.new == _chooser(fixed)(2)
    new = resize.new.layout
    assert (new.dp, new.pp) == (1, 2)
    ratio = resize.new.step_s / _price(saved.layout)
    line = resize.line()
    assert line.startswith("4 → 2 ranks: dp2 × pp2 → pp2") and line.endswith(f"; predicted {ratio:.1f}× the step time")
    assert (f", chunks {new.chunks}" in line) == (new.chunks != 2), line
    grown = decide(_saved(), world=8, policy="auto", model=MODEL, fingerprint=PRINT, choose=_chooser(fixed))
    assert grown is not None and grown.new.layout.world_size == 8 and "predicted" not in grown.line()  # no price


def test_the_same_world_or_a_fresh_start_changes_nothing():
    for saved, world in ((_saved(), 4), (None, 2)):
        assert decide(saved, world=world, policy="stop", model=MODEL, fingerprint=PRINT, choose=_chooser(Fixed())) is None


def test_flags_given_stay_constraints():
    fixed = Fixed(schedule="gpipe", chunks=4, dp_mode="ddp", checkpoint="never")
    new = decide(_saved(), world=2, policy="auto", model=MODEL, fingerprint=PRINT, choose=_chooser(fixed),
                 fixed=fixed).new.layout
    assert (new.schedule, new.chunks, new.dp_mode, new.checkpoint) == ("gpipe", 4, "ddp", "never")
    new = decide(_saved(), world=2, policy="auto", model=MODEL, fingerprint=PRINT, choose=_chooser(Fixed(dp=2)),
                 fixed=Fixed(dp=2)).new.layout
    assert (new.dp, new.pp) == (2, 1)


def test_a_world_no_layout_fits_names_the_smallest_that_works():
    def leanest(world: int) -> float:  # MB per rank of the world's leanest layout
        return min(max(predict(BLOCKS, layout, CALIB.device, CALIB.network).memory_bytes) / 2**20
                   for layout in enumerate_layouts(len(BLOCKS), world, 16, Fixed().space(64)) if layout.tp == 1)

    one, two = leanest(1), leanest(2)
    assert two < one  # two pipeline ranks hold part of the blocks each
    budget = (one + two) / 2
    with pytest.raises(ConfigError) as caught:
        decide(_saved(), world=1, policy="auto", model=MODEL, fingerprint=PRINT, choose=_chooser(Fixed(), budget))
    said = str(caught.value)
    assert said.startswith("4 ranks → 1: checkpoint '/ckpt/step-00000012' (step 12) was written by dp2 × pp2; no "
                           "layout of 1 rank can hold the job (--layout auto: no layout of 1 ranks fits"), said
    assert "the smallest world that works is 2 ranks (hint: restart with 2 ranks or more (torchrun: --nnodes " \
           "MIN:MAX with MIN × --nproc-per-node >= 2" in said, said
    with pytest.raises(ConfigError, match="no layout of 2 ranks with --pp 4 can hold the job .*the smallest world "
                                          "that works is 4 ranks .*or drop some of the layout flags"):
        decide(_saved(), world=2, policy="auto", model=MODEL, fingerprint=PRINT, choose=_chooser(Fixed(pp=4)),
               fixed=Fixed(pp=4))


def test_a_checkpoint_of_another_model_stops_the_restart():
    for saved, what in ((_saved(model="lm:tiny"), "model 'lm:tiny', this job trains 'classifier:tiny'"),
                        (_saved(print_="0" * 64), "parameters of another shape than this job's model")):
        with pytest.raises(ConfigError) as caught:
            decide(saved, world=2, policy="auto", model=MODEL, fingerprint=PRINT, choose=_chooser(Fixed()))
        assert str(caught.value) == (
            f"the restart resumes checkpoint '/ckpt/step-00000012' (step 12, 4 ranks), which holds {what} (hint: "
            "restart with the workload, preset and model flags that wrote it, or pass another --save-dir)")


def test_stop_says_what_changed_and_suggests_auto():
    with pytest.raises(ConfigError) as caught:
        decide(_saved(), world=2, policy="stop", model=MODEL, fingerprint=PRINT, choose=_chooser(Fixed()))
    assert str(caught.value) == (
        "the job's ranks changed since its checkpoint: 4 ranks → 2: checkpoint '/ckpt/step-00000012' (step 12) was "
        "written by dp2 × pp2, and --on-resize is stop (hint: pass --on-resize auto to let the planner lay out the 2 "
        "ranks (the layout flags given stay constraints), or start 4 ranks again)")


def test_describe_layout_and_flags_that_fix_the_world():
    assert [describe_layout(Layout(dp=d, pp=p, tp=t, batch=8, chunks=1)) for d, p, t in
            ((2, 2, 1), (1, 2, 1), (4, 1, 1), (1, 1, 1), (2, 2, 2))] == ["dp2 × pp2", "pp2", "dp4", "1 rank",
                                                                          "dp2 × pp2 × tp2"]
    check_fixed_world(Fixed(pp=2))
    with pytest.raises(ConfigError, match=r"--on-resize auto with --dp 2 --pp 2: these flags fix the job at 4 ranks, "
                                          r"so no smaller world satisfies them \(hint: drop --dp \(or --pp\)"):
        check_fixed_world(Fixed(dp=2, pp=2))


# --- through the flags and `prepare` (a launched rank 0, no process group) ---------------------------------------

JOB = ["train", "--preset", "tiny", "--data", "synthetic", "--train-samples", "64", "--test-samples", "16",
       "--batch-size", "16", "--no-progress", "--profile", str(PROFILE), "--calibration", str(CALIBRATION),
       "--schedule", "gpipe", "--chunks", "2"]


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args([*JOB, *argv])


def _checkpoint(save_dir: Path, model: str = MODEL) -> Path:
    """A committed step-12 checkpoint's metadata, as a dp2 x pp2 job of this model wrote it (no shards: only read)."""
    config = describe(_args("--dp", "2", "--pp", "2"))
    folder = final_folder(save_dir, 12)
    folder.mkdir(parents=True)
    write_meta(folder, CheckpointMeta(step=12, model=model, fingerprint=fingerprint(config.model()), layout=LAYOUT,
                                      world_size=4, config=CONFIG, extras={"position": {"step": 12, "in_epoch": 0}}))
    return folder


def _restart(world: int) -> ClusterEnv:
    return ClusterEnv(rank=0, world_size=world, local_rank=0, local_world_size=world, node_rank=0, num_nodes=1,
                      master_addr="127.0.0.1", master_port=29500, source="torchrun")


def test_a_launched_restart_with_fewer_ranks_is_laid_out_again(tmp_path, caplog):
    _checkpoint(tmp_path / "ckpt")
    common = ("--save-dir", str(tmp_path / "ckpt"), "--resume", "auto")
    with caplog.at_level("INFO", logger="pipetrain"):
        job = prepare(describe(_args("--layout", "auto", "--pp", "2", *common)), device="cpu", env=_restart(2))
    assert (job.config.parallel.dp, job.config.parallel.pipeline.pp) == (1, 2)
    said = [r.getMessage() for r in caplog.records if "--on-resize auto" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("pipetrain: --on-resize auto: 4 → 2 ranks: dp2 × pp2 → pp2"), said
    job = prepare(describe(_args("--on-resize", "auto", "--pp", "2", *common)), device="cpu", env=_restart(2))
    assert (job.config.parallel.dp, job.config.parallel.pipeline.pp) == (1, 2)  # manual flags: the planner fills in dp
    job = prepare(describe(_args("--on-resize", "auto", "--pp", "2", *common)), device="cpu", env=_restart(4))
    assert (job.config.parallel.dp, job.config.parallel.pipeline.pp) == (2, 2)
    with pytest.raises(ConfigError, match="the job's ranks changed since its checkpoint: 4 ranks → 2"):
        prepare(describe(_args("--dp", "2", "--pp", "2", *common)), device="cpu", env=_restart(2))
    with pytest.raises(ConfigError, match="the job's ranks changed since its checkpoint: 4 ranks → 2"):
        prepare(describe(_args("--layout", "auto", "--on-resize", "stop", *common)), device="cpu", env=_restart(2))
    with pytest.raises(ConfigError, match="the smallest world that works is 4 ranks"):
        prepare(describe(_args("--layout", "auto", "--pp", "4", *common)), device="cpu", env=_restart(2))


def test_a_restart_whose_checkpoint_is_of_another_model_is_refused(tmp_path):
    _checkpoint(tmp_path / "ckpt", model="classifier:cpu")
    with pytest.raises(ConfigError, match="the restart resumes checkpoint .* which holds model 'classifier:cpu', this "
                                          "job trains 'classifier:tiny'"):
        prepare(describe(_args("--layout", "auto", "--pp", "2", "--save-dir", str(tmp_path / "ckpt"), "--resume",
                               "auto")), device="cpu", env=_restart(2))


def test_resume_auto_resumes_only_when_a_checkpoint_is_there(tmp_path):
    args = _args("--save-dir", str(tmp_path / "ckpt"), "--resume", "auto")
    assert durable_config(args).resume is False  # the first start: afresh
    _checkpoint(tmp_path / "ckpt")
    assert durable_config(args).resume is True and durable_config(args).resume_from is None
    with pytest.raises(ConfigError, match=r"--resume auto needs --save-dir"):
        durable_config(_args("--resume", "auto"))


def test_on_resize_auto_with_flags_that_fix_the_world_is_one_message(monkeypatch, capsys):
    for name in list(os.environ):
        if name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") or name.startswith("SLURM_"):
            monkeypatch.delenv(name)
    assert cli_main.main([*JOB, "--dp", "2", "--pp", "2", "--on-resize", "auto"]) == 2
    err = capsys.readouterr().err
    assert err.count("pipetrain: error:") == 1 and "Traceback" not in err, err
    assert "--on-resize auto with --dp 2 --pp 2: these flags fix the job at 4 ranks" in err, err


def test_torchruns_shared_store_with_restarts_is_told():
    assert shared_store_restarts({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "2"}) == 2
    assert shared_store_restarts({"TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_MAX_RESTARTS": "2"}) == 0
    assert shared_store_restarts({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "0"}) == 0
    assert shared_store_restarts({}) == 0


def test_on_resize_auto_on_launched_ranks_needs_the_planners_files(tmp_path):
    no_profile = [a for a in JOB if a not in ("--profile", str(PROFILE))]
    with pytest.raises(ConfigError, match=r"--on-resize auto on ranks started by a launcher needs --profile FILE"):
        prepare(describe(build_parser().parse_args([*no_profile, "--pp", "2", "--on-resize", "auto"])), device="cpu",
                env=_restart(2))
    with pytest.raises(ConfigError, match=r"--on-resize auto on ranks started by a launcher needs a calibration file; "
                                          r"'.*missing.json' is missing"):
        prepare(describe(_args("--pp", "2", "--on-resize", "auto", "--calibration", str(tmp_path / "missing.json"))),
                device="cpu", env=_restart(2))


def test_a_context_parallel_checkpoint_s_layout_names_cp():
    """The engine's record of a cp2 x pp2 job (dp counts data replicas, cp the ranks a sequence is cut over) reads
    back as that layout, tp none."""
    layout = {**LAYOUT, "dp": 1, "cp": 2}
    config = {**CONFIG, "parallel": {**CONFIG["parallel"], "dp": 1, "cp": 2, "cp_attention": "ulysses"}}
    saved = Saved.from_meta("/ckpt/step-00000012", step=12, model=MODEL, fingerprint=PRINT, layout=layout,
                            config=config, world_size=4).layout
    assert (saved.dp, saved.pp, saved.tp, saved.cp, saved.cp_attention) == (1, 2, 1, 2, "ulysses")
    assert describe_layout(saved) == "pp2 × cp2"

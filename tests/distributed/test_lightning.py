"""PipelineStrategy: a LightningModule trained by Lightning's Trainer at pp=2 and pp=2 x dp=2 gives the losses and the
parameters of the same module trained by Lightning on one process (fp32, gloo; rtol 1e-5, atol 4e-5, torch's
pipelining tolerance), with self.log, a callback, gradient_clip_val, a per-step LR scheduler and validation at work; its
checkpoints are layout-free pipetrain checkpoints (the pp=2 x dp=2 run resumes from the pp=2 run's first epoch);
bad input is one ConfigError each. Skipped without the `lightning` extra.

Lightning's own launcher starts the ranks: the job script (tests/distributed/lightning_job.py) runs once per rank.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")

import lightning.pytorch as L  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from pipetrain.checkpoint.export import read_weights  # noqa: E402
from pipetrain.errors import ConfigError  # noqa: E402
from pipetrain.lightning import PipelineStrategy, pipeline  # noqa: E402
from tests.distributed import lightning_job as job  # noqa: E402
from tests.distributed.lightning_runs import quiet_port, run_script  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RTOL, ATOL = 1e-5, 4e-5
EPOCHS = 2
STEPS = EPOCHS * job.SAMPLES // job.BATCH


def _run_job(out: Path, pp: int, dp: int, resume: Path | None = None) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}",
           "MASTER_PORT": str(quiet_port())}  # read by Lightning's launcher
    argv = [sys.executable, str(ROOT / "tests" / "distributed" / "lightning_job.py"), str(out), str(pp), str(dp),
            str(EPOCHS), *([str(resume)] if resume else [])]
    code, output = run_script(argv, env, out / "job.log", timeout_s=240)
    assert code == 0, output[-6000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(pp * dp)]


@pytest.fixture(autouse=True)
def _environment_kept():
    """Lightning run in this process writes MASTER_ADDR/MASTER_PORT (and more) into os.environ; later tests (a Slurm
    job submitted with the test process's environment) must not inherit them."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("lightning")
    reference, weights = job.reference(folder / "reference", EPOCHS)
    pp2 = _run_job(folder / "pp2", 2, 1)
    # pp=2 x dp=2 resumes from the pp=2 run's first epoch: a layout-free checkpoint, optimizer and LR scheduler too
    hybrid = _run_job(folder / "pp2dp2", 2, 2, resume=folder / "pp2" / "epoch0.ckpt")
    return {"folder": folder, "reference": reference, "weights": weights, "pp2": pp2, "pp2dp2": hybrid}


def _close(actual: list[float], expected: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(actual, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64),
                               rtol=RTOL, atol=ATOL)


def _assert_weights(checkpoint: Path, expected: dict[str, torch.Tensor]) -> None:
    found = read_weights(checkpoint, job.Blocks())  # the state dict of build_sequential(Blocks())
    assert found.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(found[name], value, rtol=RTOL, atol=ATOL, msg=name)


def test_the_reference_clips_and_schedules(runs):
    reference = runs["reference"]
    assert len(reference.losses) == STEPS and len(reference.validation) == EPOCHS
    assert min(reference.norms) > job.CLIP  # gradient_clip_val bites at every step
    assert reference.lrs == [0.2, 0.2, 0.2, 0.1, 0.1, 0.1, 0.05, 0.05]  # StepLR(3, 0.5), stepped every step


def test_pp2_trains_like_one_process_on_every_rank(runs):
    reference = runs["reference"]
    for rank in runs["pp2"]:
        _close(rank["losses"], reference.losses)  # the callback's view of each step, on every rank
        assert rank["logged"] == rank["losses"]  # self.log("train_loss", loss)
        _close(rank["norms"], reference.norms)  # the global norm over both stages, before clipping
        assert rank["lrs"] == reference.lrs
        _close(rank["validation"], reference.validation)  # forward-only passes, after each epoch
    _assert_weights(runs["folder"] / "pp2" / "epoch1.ckpt", runs["weights"])


def test_pp2_dp2_resumed_from_pp2_trains_like_one_process(runs):
    reference = runs["reference"]
    half = STEPS // 2
    for rank in runs["pp2dp2"]:
        assert rank["world"] == 4
        _close(rank["losses"], reference.losses[half:])  # the second epoch, after the resume
        assert rank["logged"] == rank["losses"]
        _close(rank["norms"], reference.norms[half:])
        assert rank["lrs"] == reference.lrs[half:]  # the scheduler's state came back with the checkpoint
        _close(rank["validation"], reference.validation[1:])
    _assert_weights(runs["folder"] / "pp2dp2" / "epoch1.ckpt", runs["weights"])


def test_a_checkpoint_is_a_pipetrain_checkpoint_with_lightnings_state(runs):
    folder = runs["folder"] / "pp2" / "epoch0.ckpt"
    meta = json.loads((folder / "pipetrain.json").read_text())
    assert meta["step"] == STEPS // 2 and meta["layout"]["pp"] == 2
    state = torch.load(folder / "lightning.pt", weights_only=False)
    assert state["epoch"] == 0 and state["global_step"] == STEPS // 2 and state["lr_schedulers"]
    assert "state_dict" not in state  # the weights are the DCP shards, under layout-free keys


# Bad input: one ConfigError each (in this process; the errors come before any rank joins, or in a world of one)

class _NoBlocks(job.Classifier):
    def configure_model(self) -> None:
        if self.model is None:
            self.model = pipeline(self, nn.Linear(job.FEATURES, job.CLASSES))


class _NoPipeline(job.Classifier):
    def configure_model(self) -> None:
        if self.model is None:
            self.model = nn.Linear(job.FEATURES, job.CLASSES)


def _fit_alone(module: L.LightningModule, tmp_path: Path) -> None:
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=PipelineStrategy(pp=1), max_steps=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        default_root_dir=tmp_path)
    trainer.fit(module)


def test_a_module_without_a_block_model_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"pipeline\(\) got Linear, not a BlockModel") as info:
        _fit_alone(_NoBlocks(), tmp_path)
    assert "num_blocks, build_block(i) and example_input" in info.value.hint
    with pytest.raises(ConfigError, match="_NoPipeline built no pipeline for PipelineStrategy") as info:
        _fit_alone(_NoPipeline(), tmp_path)
    assert "pipetrain.lightning.pipeline(self" in info.value.hint
    assert not torch.distributed.is_initialized()  # the strategy left the process group


def test_an_unsupported_precision_and_a_world_that_does_not_fit_are_refused_when_the_trainer_is_made():
    with pytest.raises(ConfigError, match=r"does not support Trainer\(precision='bf16-mixed'\)") as info:
        L.Trainer(accelerator="cpu", devices=2, strategy=PipelineStrategy(pp=2), precision="bf16-mixed")
    assert "32-true" in info.value.hint
    with pytest.raises(ConfigError, match=r"dp=1 x pp=2 x tp=1 = 2 ranks, but the Trainer has 3 device") as info:
        L.Trainer(accelerator="cpu", devices=3, strategy=PipelineStrategy(pp=2))
    assert "devices=2" in info.value.hint
    with pytest.raises(ConfigError, match="schedule"):
        PipelineStrategy(pp=2, schedule="sideways")


def test_accumulated_gradients_are_divided_as_lightning_divides_the_loss(tmp_path):
    """accumulate_grad_batches=2 in a world of one: the handed-over gradients of two batches, each halved."""
    params = {}
    for name, strategy in (("one process", "auto"), ("strategy", PipelineStrategy(pp=1))):
        module = job.Classifier(one_process=name == "one process")
        L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_epochs=1, accumulate_grad_batches=2,
                  limit_val_batches=0, logger=False, enable_progress_bar=False,  # no clipping: the scale shows
                  enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path).fit(module)
        named = module.model.engine.named_parameters() if name == "strategy" else module.model.named_parameters()
        params[name] = {key: value.detach().clone() for key, value in named}
    assert params["strategy"].keys() == params["one process"].keys()
    for key, value in params["one process"].items():
        torch.testing.assert_close(params["strategy"][key], value, rtol=RTOL, atol=ATOL, msg=key)

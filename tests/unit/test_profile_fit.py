"""Multi-size profiles: the fixed + per-sample fit, format 2 round trip, format-1 files still load, the planner's use."""

from __future__ import annotations

import json

import pytest

from pipetrain.partition.fit import fit_line, fit_profiles
from pipetrain.partition.profile import (PROFILE_FORMAT, PROFILE_FORMAT_FITTED, BlockProfile, ModelProfile,
                                         load_profile, profile_to_dict, save_profile)
from pipetrain.plan.hardware import default_device
from pipetrain.plan.model import profile_blocks
from pipetrain.plan.predict import block_times


def _at(size: int, fixed: float = 1e-3, slope: float = 2e-4) -> ModelProfile:
    blocks = tuple(BlockProfile(index=i, name=f"B{i}", forward_s=fixed + slope * size,
                                backward_s=2 * fixed + 2 * slope * size, param_bytes=400, activation_bytes=100 * size,
                                output_bytes=10 * size) for i in range(3))
    return ModelProfile(model="m", fingerprint="f" * 64, micro_batch_size=size, device="cpu", dtype="float32",
                        repeats=3, blocks=blocks)


def test_fit_line_recovers_a_line_and_never_goes_negative():
    fixed, slope = fit_line([1, 2, 4, 8], [3.0 + 0.5 * n for n in (1, 2, 4, 8)])
    assert fixed == pytest.approx(3.0) and slope == pytest.approx(0.5)
    assert fit_line([1, 2, 4], [0.5, 2.0, 5.0])[0] == 0.0  # a negative intercept: through the origin
    assert fit_line([1, 2, 4], [3.0, 2.0, 1.0])[1] == 0.0  # a falling cost: flat


def test_fitted_profile_round_trips_as_format_2_and_predicts_every_size(tmp_path):
    fitted = fit_profiles([_at(n) for n in (1, 2, 4, 8)], reference=8)
    assert fitted.sizes == (1, 2, 4, 8) and fitted.fitted
    path = tmp_path / "p.json"
    save_profile(fitted, path)
    assert json.loads(path.read_text())["format"] == PROFILE_FORMAT_FITTED
    loaded = load_profile(path)
    assert loaded == fitted
    block = loaded.blocks[1]
    assert block.forward_fixed_s == pytest.approx(1e-3) and block.forward_s == pytest.approx(1e-3 + 8 * 2e-4)
    one = loaded.rescaled(1).blocks[1]  # the fixed part is kept, not scaled down with the samples
    assert one.forward_s == pytest.approx(1.2e-3) and one.backward_s == pytest.approx(2.4e-3)
    cost = profile_blocks(loaded)[1]
    for n in (1, 3, 16):  # the planner's block time is the fitted line at any micro-batch size
        forward, backward = block_times(cost, n, default_device())
        assert forward == pytest.approx(1e-3 + 2e-4 * n) and backward == pytest.approx(2e-3 + 4e-4 * n)
    assert "fitted over micro-batch sizes 1, 2, 4, 8" in loaded.describe()


def test_a_format_1_file_still_loads_and_rescales_linearly(tmp_path):
    old = {"format": "pipetrain-profile/1", "model": "classifier:tiny", "fingerprint": "a" * 64,
           "micro_batch_size": 8, "device": "cpu", "dtype": "float32", "repeats": 5,
           "blocks": [{"index": 0, "name": "EmbeddingBlock", "forward_s": 0.0008, "backward_s": 0.0016,
                       "param_bytes": 128000, "activation_bytes": 2048, "output_bytes": 32768}]}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    profile = load_profile(path)
    assert not profile.fitted and profile.blocks[0].forward_fixed_s == 0.0
    assert profile.rescaled(4).blocks[0].forward_s == pytest.approx(0.0004)
    forward, _ = block_times(profile_blocks(profile)[0], 1, default_device())
    assert forward == pytest.approx(0.0001)
    assert "rescaled linearly" in profile.describe()
    save_profile(profile, tmp_path / "again.json")  # one size is still written as format 1
    assert json.loads((tmp_path / "again.json").read_text()) == old


def test_fit_refuses_one_size_and_mixed_models():
    from pipetrain.errors import ConfigError

    with pytest.raises(ConfigError, match="two or more different"):
        fit_profiles([_at(4), _at(4)])
    other = _at(2)
    other = ModelProfile(**{**other.__dict__, "fingerprint": "e" * 64})
    with pytest.raises(ConfigError, match="different models"):
        fit_profiles([_at(1), other])

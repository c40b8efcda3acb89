"""The per-block profile file format: round trip, malformed files, model/micro-batch mismatches."""

from __future__ import annotations

import json

import pytest

from pipetrain.errors import ConfigError
from pipetrain.partition.profile import (
    PROFILE_FORMAT,
    BlockProfile,
    ModelProfile,
    fingerprint_of,
    load_profile,
    profile_to_dict,
    save_profile,
)


def _profile(micro_batch_size: int = 8) -> ModelProfile:
    blocks = tuple(
        BlockProfile(
            index=i, name=f"Block{i}", forward_s=0.001 * (i + 1), backward_s=0.0025 * (i + 1),
            param_bytes=1000 * (i + 1), activation_bytes=4567 + i, output_bytes=789 * (i + 1),
        )
        for i in range(3)
    )
    return ModelProfile(
        model="classifier:cpu", fingerprint=fingerprint_of([("A", [("w", (2, 3), "float32")])]),
        micro_batch_size=micro_batch_size, device="cpu", dtype="float32", repeats=5, blocks=blocks,
    )


def test_round_trip_is_exact(tmp_path):
    profile = _profile()
    path = tmp_path / "sub" / "p.json"
    save_profile(profile, path)
    assert load_profile(path) == profile
    data = json.loads(path.read_text())
    assert data["format"] == PROFILE_FORMAT
    assert set(data["blocks"][0]) == {
        "index", "name", "forward_s", "backward_s", "param_bytes", "activation_bytes", "output_bytes"
    }
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temporary left


def test_fingerprint_depends_on_names_shapes_dtypes_and_classes():
    base = [("Lin", [("weight", (4, 2), "float32"), ("bias", (4,), "float32")])]
    assert fingerprint_of(base) == fingerprint_of([("Lin", [("weight", [4, 2], "float32"), ("bias", [4], "float32")])])
    variants = [
        [("Lin", [("weight", (4, 3), "float32"), ("bias", (4,), "float32")])],
        [("Lin", [("weight", (4, 2), "float64"), ("bias", (4,), "float32")])],
        [("Lin", [("w", (4, 2), "float32"), ("bias", (4,), "float32")])],
        [("Conv", [("weight", (4, 2), "float32"), ("bias", (4,), "float32")])],
        base + [("Lin", [])],
    ]
    assert len({fingerprint_of(v) for v in variants} | {fingerprint_of(base)}) == len(variants) + 1


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda d: d.update(format="pipetrain-profile/9"), "format"),
        (lambda d: d["blocks"][1].pop("backward_s"), "backward_s"),
        (lambda d: d["blocks"][0].update(forward_s=-1.0), "forward_s"),
        (lambda d: d["blocks"][0].update(param_bytes=1.5), "param_bytes"),
        (lambda d: d["blocks"][2].update(index=7), "index 7"),
        (lambda d: d.update(micro_batch_size=0), "micro_batch_size"),
        (lambda d: d.update(blocks=[]), "blocks"),
    ],
)
def test_malformed_file_is_a_config_error_naming_the_field(tmp_path, mutate, expected):
    data = profile_to_dict(_profile())
    mutate(data)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=expected):
        load_profile(path)


def test_not_json_and_missing_file(tmp_path):
    path = tmp_path / "p.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not a valid"):
        load_profile(path)
    with pytest.raises(ConfigError, match="cannot read"):
        load_profile(tmp_path / "missing.json")


def test_unwritable_target_is_a_config_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a file where a folder is needed: fails even for root
    with pytest.raises(ConfigError, match="cannot write"):
        save_profile(_profile(), blocker / "p.json")


def test_mismatch_of_model_or_micro_batch_size():
    profile = _profile(micro_batch_size=8)
    profile.check_matches(fingerprint=profile.fingerprint, micro_batch_size=8)
    with pytest.raises(ConfigError, match="another model"):
        profile.check_matches(fingerprint="0" * 64, micro_batch_size=8)
    with pytest.raises(ConfigError, match="micro-batch size 8, this run uses 4"):
        profile.check_matches(fingerprint=profile.fingerprint, micro_batch_size=4)


def test_rescaled_scales_bytes_and_times_but_not_parameters():
    half = _profile(micro_batch_size=8).rescaled(4)
    assert half.micro_batch_size == 4
    assert half.blocks[0].activation_bytes == round(4567 / 2)
    assert half.blocks[0].param_bytes == 1000
    assert half.blocks[1].forward_s == pytest.approx(0.001)


def test_module_imports_no_torch():
    import ast

    import pipetrain.partition.profile as module

    tree = ast.parse(open(module.__file__).read())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not [name for name in imported if name.split(".")[0] == "torch"]

"""The generator states a checkpoint keeps: the CPU's and CUDA's under their own keys, saved and restored with DCP in
one process; CUDA is faked (its state functions patched) so the key layout is tested without a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from pipetrain.checkpoint.rng import cuda_rng_key, restore_rng, rng_key, rng_state, rng_targets
from pipetrain.checkpoint.state import saved_keys


class FakeCuda:
    """torch.cuda's generator functions over one 16-byte Philox-sized state (seed and offset), as on a GPU."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.state = torch.arange(16, dtype=torch.uint8)
        self.on = True  # off while DCP itself runs (it would look for CUDA streams)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: self.on)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: self.on)
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": self.state.clone())
        monkeypatch.setattr(torch.cuda, "set_rng_state", self.set)

    def set(self, state: torch.Tensor, device="cuda") -> None:
        self.state = state.clone()


def _save(folder, state, cuda: FakeCuda | None = None) -> set[str]:
    _dcp(dcp.save, folder, state, cuda)
    return saved_keys(folder)


def _dcp(fn, folder, state, cuda: FakeCuda | None) -> None:
    if cuda is not None:
        cuda.on = False
    fn(state, checkpoint_id=str(folder))
    if cuda is not None:
        cuda.on = True


def test_cuda_state_has_its_own_key_and_comes_back(tmp_path, monkeypatch):
    cuda = FakeCuda(monkeypatch)
    torch.manual_seed(7)
    state = rng_state(3)
    assert set(state) == {"rng.rank3", "rng_cuda.rank3"}
    assert state[rng_key(3)].shape == torch.get_rng_state().shape and state[cuda_rng_key(3)].shape == (16,)
    keys = _save(tmp_path / "ckpt", state, cuda)
    assert {"rng.rank3", "rng_cuda.rank3"} <= keys
    expected_cpu = torch.rand(4)
    torch.rand(100)  # both streams move on after the save
    cuda.state = torch.zeros(16, dtype=torch.uint8)
    targets = rng_targets(3, keys)
    _dcp(dcp.load, tmp_path / "ckpt", targets, cuda)
    assert restore_rng(targets, 3) is True
    torch.testing.assert_close(torch.rand(4), expected_cpu)
    assert torch.equal(cuda.state, torch.arange(16, dtype=torch.uint8))


def test_a_cuda_checkpoint_loads_on_the_cpu_and_the_reverse(tmp_path, monkeypatch):
    with monkeypatch.context() as patched:
        cuda_keys = _save(tmp_path / "cuda", rng_state(0), FakeCuda(patched))
    targets = rng_targets(0, cuda_keys)  # on the CPU: the CUDA key is left unread
    assert set(targets) == {"rng.rank0"}
    dcp.load(targets, checkpoint_id=str(tmp_path / "cuda"))
    assert restore_rng(targets, 0) is True

    cpu_keys = _save(tmp_path / "cpu", rng_state(0))
    assert cpu_keys >= {"rng.rank0"} and "rng_cuda.rank0" not in cpu_keys
    cuda = FakeCuda(monkeypatch)
    targets = rng_targets(0, cpu_keys)
    assert set(targets) == {"rng.rank0"}
    _dcp(dcp.load, tmp_path / "cpu", targets, cuda)
    assert restore_rng(targets, 0) is False  # the CUDA stream stays as seeded: said, not hidden
    assert torch.equal(cuda.state, torch.arange(16, dtype=torch.uint8))

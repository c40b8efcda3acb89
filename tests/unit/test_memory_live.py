"""The live-bytes counter (`compat/live.py`): storages an operator creates count until they die, and a storage
resized in place (FSDP2's way of freeing and re-gathering its weights) counts at its new size, once."""

from __future__ import annotations

import gc

import torch

from pipetrain.compat.live import LiveBytes


def test_a_storage_counts_until_it_dies():
    with LiveBytes() as live:
        kept = torch.ones(1000)
        dropped = torch.ones(500)
        assert live.bytes == 6000
        del dropped
        gc.collect()
        assert (live.bytes, live.peak) == (4000, 6000)
        view = kept[10:]  # the same storage: not counted again
        assert live.bytes == 4000 and view.untyped_storage().nbytes() == 4000


def test_a_storage_resized_in_place_counts_at_its_size_once_per_cycle():
    gathered, source = torch.empty(1000), torch.zeros(1000)  # made before the counter: met first when resized
    storage, original = gathered.untyped_storage(), torch.UntypedStorage.resize_
    with LiveBytes() as live:
        for _ in range(3):  # FSDP2 frees by resizing to 0 and gathers again into the same storage
            storage.resize_(0)
            assert live.bytes == 0
            storage.resize_(4000)
            gathered.copy_(source)  # an operator writing into it: the same storage, not counted again
            assert live.bytes == 4000
        assert live.peak == 4000
    assert torch.UntypedStorage.resize_ is original  # the counter's hook is gone with it
    storage.resize_(0)
    assert live.bytes == 4000  # no longer told

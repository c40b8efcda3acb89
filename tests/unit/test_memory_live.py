"""The live-bytes counter (`compat/live.py`): storages an operator creates count until they die, and a storage
resized in place (FSDP2's way of freeing and re-gathering its weights) counts at its new size, once."""

from __future__ import annotations

import gc

import torch

from pipetrain.compat.live import LiveBytes, live_storages


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


def test_existing_storages_are_held_not_counted_again_through_their_views():
    layer = torch.nn.Linear(100, 10)  # its forward makes a transposed view of its weight
    inputs = torch.ones(4, 100)
    with LiveBytes() as plain:
        layer(inputs)
    with LiveBytes(existing=live_storages()) as live:
        out = layer(inputs)
    assert plain.peak == 4000 + 4 * 10 * 4  # the weight met through its view, counted as made
    assert live.peak == 4 * 10 * 4 and live.held >= 4000 + 40 + 1600
    assert out.shape == (4, 10)
    del layer, out  # the output's graph holds the weight's view
    gc.collect()
    assert live.bytes == -4040  # held storages that die count down (the output's 160 bytes went with it)

"""One `Workload.model(preset, *, seq_len=None)`: every built-in workload takes it, one without a window refuses a
window, and a subclass written before (`model(self, preset)`) keeps working with a DeprecationWarning."""

from __future__ import annotations

import pytest

from pipetrain.errors import ConfigError
from pipetrain.workloads.lm.workload import LanguageModelWorkload
from pipetrain.workloads.registry import get_workload


@pytest.mark.parametrize("name, preset", [("classifier", "tiny"), ("lm", "tiny")])
def test_built_in_workloads_take_seq_len(name, preset):
    workload = get_workload(name)
    assert workload.model(preset, seq_len=None).num_blocks == workload.model(preset).num_blocks
    if not workload.windows:
        with pytest.raises(ConfigError, match="has no window to change"):
            workload.model(preset, seq_len=16)


def test_an_old_model_signature_keeps_working_with_a_warning():
    with pytest.warns(DeprecationWarning, match=r"model\(self, preset\) takes no seq_len"):
        class Old(LanguageModelWorkload):
            name = "old"

            def model(self, preset):
                return super().model(preset)

    workload = Old()
    assert workload.model("tiny").num_blocks == workload.model("tiny", seq_len=None).num_blocks
    with pytest.raises(ConfigError, match="workload 'old' has no window to change: --seq-len does not apply"):
        workload.model("tiny", seq_len=16)

"""Declared tensor-parallel abilities: `tp_plan_hook` declares whether a plan takes `loss_parallel`, read before the
hook is called (no error is caught); an undeclared hook is read from its signature."""

from __future__ import annotations

import pytest

from pipetrain.blocks import TPAbility, tp_ability, tp_plan_hook
from pipetrain.errors import ConfigError
from pipetrain.parallel.tensor import block_plans
from pipetrain.workloads.lm.gpt import GPTModel
from pipetrain.workloads.lm.presets import GPT_PRESETS


class _Declared(GPTModel):
    calls = 0

    @tp_plan_hook(loss_parallel=False)
    def tp_plan(self, index, tp, **kwargs):
        _Declared.calls += 1
        return super().tp_plan(index, tp, **kwargs)


class _Broken(GPTModel):
    @tp_plan_hook(loss_parallel=True)
    def tp_plan(self, index, tp, *, sequence_parallel=False, loss_parallel=False):
        raise TypeError("a bug in the hook, about loss_parallel")


def test_the_declaration_is_read_and_the_hook_not_called():
    assert tp_ability(GPTModel(GPT_PRESETS["tiny"])) == TPAbility(loss_parallel=True)
    with pytest.raises(ConfigError, match="has no vocabulary-parallel head"):
        block_plans(_Declared(GPT_PRESETS["tiny"]), 2, loss_parallel=True)
    assert _Declared.calls == 0
    assert block_plans(_Declared(GPT_PRESETS["tiny"]), 2)[1]


def test_an_error_inside_a_hook_is_not_taken_for_a_missing_ability():
    with pytest.raises(TypeError, match="a bug in the hook"):
        block_plans(_Broken(GPT_PRESETS["tiny"]), 2, loss_parallel=True)


def test_undeclared_hooks_are_read_from_their_signature():
    class Keyword:
        def tp_plan(self, index, tp, *, sequence_parallel=False, loss_parallel=False): ...

    class Anything:
        def tp_plan(self, index, tp, **kwargs): ...

    class Old:
        def tp_plan(self, index, tp, *, sequence_parallel=False): ...

    assert tp_ability(Keyword()).loss_parallel and tp_ability(Anything()).loss_parallel
    assert tp_ability(Old()) == TPAbility(loss_parallel=False) and tp_ability(object()) is None

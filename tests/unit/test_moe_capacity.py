"""Expert capacity (`--moe-capacity`): the slots each expert takes (hand-computed), a Qwen3-MoE layer whose experts'
output equals a per-token loop over the kept slots (exact: fp32, the same sums), no drop by default or with room
for every slot, the dropped count and fraction reaching steps.jsonl's record, and bad factors refused in one line.
(ep 1 against ep 2 on the same tokens: tests/distributed/test_moe_dispatch.py.)"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pipetrain.blocks import build_blocks  # noqa: E402
from pipetrain.errors import ConfigError  # noqa: E402
from pipetrain.logs.records import StepRecord, record_dict  # noqa: E402
from pipetrain.moe.balance import ExpertBalancer, routed_blocks  # noqa: E402
from pipetrain.moe.capacity import capacity_of, check_capacity, within_capacity  # noqa: E402
from pipetrain.workloads.hf.causal_lm import HFCausalLM  # noqa: E402
from tests.moe_folders import SEQ, moe_configs  # noqa: E402

#: the experts' output against the loop over kept slots: fp32, the same products summed in another order
RTOL, ATOL = 1e-5, 4e-5


def test_slots_beyond_capacity_are_dropped_first_choices_first():
    # 4 tokens, top-2 of 4 experts, factor 1: capacity ceil(1 * 4 * 2 / 4) = 2 slots per expert.
    # Served first choices first: expert 0 gets t0, t1 (first choices), then t2's first choice and t3's second are
    # dropped; expert 1 gets t3 (first), t0 (second), drops t2's second; expert 2 gets t1's second.
    index = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    assert capacity_of(4, 2, 4, 1.0) == 2
    keep = within_capacity(index, 4, 1.0)
    assert keep.tolist() == [[True, True], [True, True], [False, False], [True, False]]
    assert within_capacity(index, 4, 2.0).all()  # capacity 4: room for every slot
    assert within_capacity(index, 4, 0.25).sum().item() == 3  # capacity 1: one slot per used expert


def _layer(capacity: float | None):
    """Layer 1 of the tiny Qwen3-MoE (routed, 8 experts, top-2), without the load-balancing statistics."""
    config = moe_configs()["qwen3_moe"]
    config.output_router_logits = False
    model = HFCausalLM(config, seq_len=SEQ).with_capacity(capacity)
    (block,) = build_blocks(model, [2], seed=0)
    return block.train()


def _moe_io(block, hidden):
    """The layer's output and its MoE block's (input, output), recorded by a hook."""
    moe = block._moe_blocks[0]
    seen = {}
    handle = moe.register_forward_hook(lambda m, args, out: seen.update(x=args[0], y=out))
    try:
        out = block(hidden)
    finally:
        handle.remove()
    return out, seen["x"], seen["y"]


def _loop_reference(moe, x: torch.Tensor, factor: float) -> tuple[torch.Tensor, int]:
    """The MoE block's output token by token: each kept slot's expert times its router weight (slots served in
    choice-major order, each expert counting what it took); the number of dropped slots."""
    rows = x.reshape(-1, x.shape[-1])
    gate, experts = moe.gate, moe.experts
    probs = torch.softmax(rows @ gate.weight.t(), dim=-1)
    top, index = torch.topk(probs, gate.top_k, dim=-1)
    if gate.norm_topk_prob:
        top = top / top.sum(-1, keepdim=True)
    limit = math.ceil(factor * rows.shape[0] * gate.top_k / gate.num_experts)
    taken = [0] * gate.num_experts
    out, dropped = torch.zeros_like(rows), 0
    for choice in range(gate.top_k):
        for n in range(rows.shape[0]):
            e = int(index[n, choice])
            if taken[e] >= limit:
                dropped += 1
                continue
            taken[e] += 1
            g, u = (rows[n] @ experts.gate_up_proj[e].t()).chunk(2)
            out[n] += top[n, choice] * ((experts.act_fn(g) * u) @ experts.down_proj[e].t())
    return out.view_as(x), dropped


def test_a_layer_drops_exactly_the_slots_beyond_capacity():
    torch.manual_seed(0)
    hidden = torch.randn(3, SEQ, 64)
    block = _layer(0.5)  # 48 tokens x 2 / 8 experts x 0.5: 6 slots per expert, of 12 on average
    _, x, y = _moe_io(block, hidden)
    with torch.no_grad():
        expected, dropped = _loop_reference(block._moe_blocks[0], x, 0.5)
    torch.testing.assert_close(y, expected, rtol=RTOL, atol=ATOL)
    assert dropped > 0 and block.dropped_slots.item() == dropped
    assert block.tokens_per_expert.sum().item() == hidden.shape[0] * SEQ * 2  # the router's choices, before drops
    # a token whose every slot was dropped passes the MoE block unchanged (its residual path only)
    keep = within_capacity(torch.topk(block._moe_blocks[0].gate(x.reshape(-1, 64))[0], 2, -1).indices, 8, 0.5)
    lost = (~keep).all(dim=1)
    assert torch.equal(y.reshape(-1, 64)[lost], torch.zeros_like(y.reshape(-1, 64)[lost]))


def test_no_capacity_and_ample_capacity_drop_nothing():
    torch.manual_seed(1)
    hidden = torch.randn(2, SEQ, 64)
    plain, ample = _layer(None), _layer(4.0)  # 4 = E / k: every slot fits even if all go to one expert
    out = plain(hidden)
    torch.testing.assert_close(ample(hidden), out, rtol=0, atol=0)
    assert plain.dropped_slots is None and ample.dropped_slots.item() == 0


def test_the_step_record_carries_load_and_dropped_fraction():
    torch.manual_seed(2)
    block = _layer(0.5)
    block(torch.randn(2, SEQ, 64))
    balancer = ExpertBalancer(routed_blocks([block]))
    dropped_slots = block.dropped_slots.item()
    imbalance = balancer.after_step()
    assert balancer.dropped == {1: (dropped_slots, 2 * SEQ * 2.0)} and imbalance[1] >= 1.0
    assert block.dropped_slots is None  # counted again from the next step
    base = dict(step=1, epoch=0, loss=1.0, lr=1e-3, samples=2, step_time_s=0.1, samples_per_s=20.0)
    line = record_dict(StepRecord(**base, expert_load={1: imbalance[1]}, dropped_fraction=0.25))
    assert line["expert_load"] == {1: imbalance[1]} and line["dropped_fraction"] == 0.25
    plain = record_dict(StepRecord(**base))
    assert "expert_load" not in plain and "dropped_fraction" not in plain  # a dense model's lines as before
    assert "dropped_fraction" in record_dict(StepRecord(**base, expert_load={1: 1.0}, dropped_fraction=0.0))
    assert "drop" not in ExpertBalancer([]).line({1: 1.5}) and "dropped 25.00%" in ExpertBalancer([]).line({1: 1.5},
                                                                                                            0.25)


@pytest.mark.parametrize("factor", [0, -1.0, float("nan"), float("inf"), "1.5"])
def test_a_bad_capacity_factor_is_one_line(factor):
    with pytest.raises(ConfigError, match=r"--moe-capacity .* is not a positive number") as error:
        check_capacity(factor)
    assert "\n" not in str(error.value)


def test_capacity_on_a_dense_model_is_refused():
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=64)
    with pytest.raises(ConfigError, match="has no experts"):
        HFCausalLM(config, seq_len=SEQ).with_capacity(1.0)

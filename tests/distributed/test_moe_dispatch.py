"""Expert parallelism's dispatch and combine, and the split experts module, on 2 gloo ranks (one spawned job).

Each rank routes its own tokens (rank 0: 7 tokens, rank 1: 5, or none at all in the "empty" case) to the top-2 of 4
experts, experts 0-1 on rank 0 and 2-3 on rank 1. The routing is made so that expert 3 receives no token and rank 0
sends rank 1 nothing in the "lopsided" case. Checked: every (token, expert) pair reaches its expert once (the token
ids each local expert receives, against those all ranks routed to it); dispatch + combine with identity experts
gives back every token (weights summing to 1); the gradient through dispatch and combine; `ExpertParallelExperts`
against transformers' own `Qwen3MoeExperts` holding all experts (each rank's outputs and input gradients; the
expert gradients, summed over the ranks' tokens), with grouped matmuls and with the loop over local experts, and
against GPT-OSS's `GptOssExperts` (transposed, gate and up interleaved, biases, its clamped SwiGLU with a limit
small enough to clamp; the bias gradients too), within rtol 1e-5 / atol 4e-5 (fp32: only the order of the sums
differs). Expert capacity (`--moe-capacity`, defined per
routing rank before the all-to-all): a Qwen3-MoE layer drops the same slots, and gives the same outputs and input
gradients, with its experts whole (ep 1) and split over the 2 ranks (ep 2), each rank routing its own tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import torch.distributed as dist  # noqa: E402

from pipetrain.errors import ConfigError  # noqa: E402
from pipetrain.launch.env import free_port  # noqa: E402
from pipetrain.launch.spawn import RankSpec, spawn  # noqa: E402
from pipetrain.moe.dispatch import combine, dispatch  # noqa: E402
from pipetrain.moe.experts import ExpertParallelExperts  # noqa: E402
from pipetrain.moe.balance import ExpertBalancer, routed_blocks  # noqa: E402
from pipetrain.moe.split import expert_parallel_blocks  # noqa: E402
from pipetrain.train.loop import _expert_load  # noqa: E402
from pipetrain.blocks import build_blocks  # noqa: E402
from pipetrain.session import close_session, join_job  # noqa: E402
from pipetrain.workloads.hf.causal_lm import HFCausalLM  # noqa: E402
from tests.moe_folders import SEQ, moe_configs  # noqa: E402

RTOL, ATOL = 1e-5, 4e-5
EXPERTS, TOP_K, HIDDEN, INTER = 4, 2, 32, 16
WORLD = 2


def _routing(case: str, rank: int) -> torch.Tensor:
    """Each token's two experts: never expert 3; in "lopsided", rank 0's tokens only go to experts 0 and 1."""
    tokens = {"uneven": (7, 5), "lopsided": (6, 3), "empty": (4, 0)}[case][rank]
    gen = torch.Generator().manual_seed(10 * rank + len(case))
    choices = torch.tensor([[0, 1], [1, 0]]) if case == "lopsided" and rank == 0 else \
        torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2]])
    return choices[torch.randint(0, len(choices), (tokens,), generator=gen)]


def _hidden(case: str, rank: int, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + rank + len(case))
    return torch.randn(n, HIDDEN, generator=gen)


def _weights(case: str, rank: int, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(200 + rank + len(case))
    return torch.rand(n, TOP_K, generator=gen).softmax(-1)


def _routing_checks(case: str, rank: int) -> dict:
    index = _routing(case, rank)
    n = index.shape[0]
    ids = torch.arange(n, dtype=torch.float32) + 1000 * rank  # a token's global id in column 0
    hidden = _hidden(case, rank, n)
    hidden[:, 0] = ids
    sent = dispatch(hidden, index, EXPERTS, dist.group.WORLD)
    local = EXPERTS // WORLD
    received, start = {}, 0
    for j, count in enumerate(sent.counts_list):
        received[rank * local + j] = sorted(sent.tokens[start:start + count, 0].tolist())
        start += count
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, (rank, index.tolist()))
    expected = {e: sorted(1000 * r + t for r, rows in everyone for t, row in enumerate(rows) for x in row if x == e)
                for e in received}
    # identity experts: combine gives each token back (its weights sum to 1)
    weights = _weights(case, rank, n)
    x = hidden.clone().requires_grad_(True)
    routed = dispatch(x, index, EXPERTS, dist.group.WORLD)
    back = combine(routed.tokens, routed, weights)
    grad = torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(rank))
    back.backward(grad)
    return {"received": received, "expected": expected, "identity": (back.detach(), hidden),
            "identity_grad": (x.grad, grad), "counts": sent.counts.tolist()}


def _qwen_experts() -> torch.nn.Module:
    config = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS,
                                         num_experts_per_tok=TOP_K, hidden_act="silu")
    config._experts_implementation = "eager"
    full = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(config)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(5)
        full.gate_up_proj.copy_(torch.randn(full.gate_up_proj.shape, generator=gen) * 0.2)
        full.down_proj.copy_(torch.randn(full.down_proj.shape, generator=gen) * 0.2)
    return full


def _gpt_oss_experts() -> torch.nn.Module:
    config = transformers.GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS,
                                       num_experts_per_tok=TOP_K, swiglu_limit=0.3)
    config._experts_implementation = "eager"
    full = transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts(config)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(6)
        for param in full.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return full


def _experts_checks(case: str, rank: int, grouped: bool | None, family: str = "qwen") -> dict:
    full = _gpt_oss_experts() if family == "gpt_oss" else _qwen_experts()
    split = ExpertParallelExperts(full, dist.group.WORLD, grouped=grouped)
    local = slice(split.first_expert, split.first_expert + split.local_experts)
    out = {}
    for r in range(WORLD):  # the reference: the full module on every rank's tokens, its expert gradients summed
        index = _routing(case, r)
        x = _hidden(case, r, index.shape[0]).requires_grad_(True)
        y = full(x, index, _weights(case, r, index.shape[0]))
        if y.requires_grad:  # transformers' module gives no graph for no token
            y.backward(torch.ones_like(y) * (r + 1))
        if r == rank:
            out["ref_out"], out["ref_dx"] = y.detach(), x.grad if x.grad is not None else torch.zeros_like(x)
    index = _routing(case, rank)
    x = _hidden(case, rank, index.shape[0]).requires_grad_(True)
    y = split(x, index, _weights(case, rank, index.shape[0]))
    y.backward(torch.ones_like(y) * (rank + 1))
    grads = {name: (param.grad, dict(full.named_parameters())[name].grad[local])
             for name, param in split.named_parameters()}
    return {"out": (y.detach(), out["ref_out"]), "dx": (x.grad, out["ref_dx"]), "grads": grads}


def _capacity_checks(rank: int) -> dict:
    """Layer 1 of the tiny Qwen3-MoE at capacity factor 0.5 on this rank's tokens (2 or 3 samples), at ep 1 and 2:
    (output, input gradient, dropped slots) of each."""
    config = moe_configs()["qwen3_moe"]
    config.output_router_logits = False
    model = HFCausalLM(config, seq_len=SEQ).with_capacity(0.5)
    hidden = torch.randn(2 + rank, SEQ, config.hidden_size, generator=torch.Generator().manual_seed(300 + rank))
    out = {}
    for ep in (1, 2):
        (block,) = build_blocks(model, [2], seed=0)
        if ep == 2:
            block = expert_parallel_blocks(dist.group.WORLD)(2, block)
        x = hidden.clone().requires_grad_(True)
        y = block.train()(x)
        y.backward(torch.ones_like(y))
        out[ep] = (y.detach(), x.grad, block.dropped_slots.item())
    # the step record's figures, as the training loop takes them: the two ranks as two replicas of the layer
    out["record"] = _expert_load(ExpertBalancer(routed_blocks([block]), dist.group.WORLD), 1, 1, rank == 0, 0.5)
    return out


def _worker(spec: RankSpec, out: str) -> None:
    join_job(spec)
    try:
        rank = dist.get_rank()
        records = {case: _routing_checks(case, rank) for case in ("uneven", "lopsided", "empty")}
        for case in ("uneven", "empty"):
            for grouped in (True, False):
                records[f"experts-{case}-{'grouped' if grouped else 'loop'}"] = _experts_checks(case, rank, grouped)
            records[f"experts-{case}-gpt_oss"] = _experts_checks(case, rank, None, "gpt_oss")
        records["capacity"] = _capacity_checks(rank)
        try:
            ExpertParallelExperts(_qwen_experts_of(3), dist.group.WORLD)
        except ConfigError as error:
            records["refused"] = str(error)
        torch.save(records, Path(out) / f"rank{rank}.pt")
    finally:
        close_session()


def _qwen_experts_of(num: int) -> torch.nn.Module:
    config = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=num)
    return transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(config)


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("moe-dispatch")
    spawn(_worker, ranks=range(WORLD), world_size=WORLD, master_addr="127.0.0.1", master_port=free_port(),
          args=(str(out),), timeout_s=300)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.parametrize("case", ["uneven", "lopsided", "empty"])
def test_every_token_reaches_its_top_k_experts_once(records, case):
    for record in records:
        assert record[case]["received"] == record[case]["expected"]
    assert records[1][case]["counts"][1] == 0  # expert 3 received no token


def test_lopsided_routing_sends_one_rank_nothing(records):
    assert records[0]["lopsided"]["received"][0] and records[0]["lopsided"]["received"][1]
    assert all(token >= 1000 for tokens in records[1]["lopsided"]["received"].values() for token in tokens)


@pytest.mark.parametrize("case", ["uneven", "lopsided", "empty"])
def test_dispatch_then_combine_is_the_identity_with_identity_experts(records, case):
    for record in records:
        for name in ("identity", "identity_grad"):
            got, expected = record[case][name]
            torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("case", ["experts-uneven-grouped", "experts-uneven-loop", "experts-empty-grouped",
                                  "experts-empty-loop", "experts-uneven-gpt_oss", "experts-empty-gpt_oss"])
def test_split_experts_equal_transformers_experts(records, case):
    expected_grads = {"gate_up_proj", "down_proj"} | ({"gate_up_proj_bias", "down_proj_bias"} if "gpt_oss" in case
                                                       else set())
    for record in records:
        assert set(record[case]["grads"]) == expected_grads
        pairs = [("out", record[case]["out"]), ("dx", record[case]["dx"]), *record[case]["grads"].items()]
        for name, (got, expected) in pairs:
            assert got is not None and expected is not None, name
            torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def test_ep_not_dividing_the_experts_is_refused(records):
    assert records[0]["refused"].startswith("--ep 2 does not divide the 3 experts")


def test_capacity_drops_the_same_slots_at_ep1_and_ep2(records):
    for record in records:
        (y1, dx1, dropped1), (y2, dx2, dropped2) = record["capacity"][1], record["capacity"][2]
        assert dropped1 == dropped2 > 0  # decided on the routing rank, before the all-to-all
        torch.testing.assert_close(y2, y1, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(dx2, dx1, rtol=RTOL, atol=ATOL)


def test_the_step_record_sums_the_dropped_slots_over_the_replicas(records):
    dropped = sum(record["capacity"][2][2] for record in records)
    routed = sum((2 + rank) * SEQ * 2 for rank in range(WORLD))  # each rank's tokens x top-2
    for record in records:
        figures = record["capacity"]["record"]
        assert figures["dropped_fraction"] == pytest.approx(dropped / routed)
        assert set(figures["expert_load"]) == {1} and figures["expert_load"][1] >= 1.0

"""Mixtures of experts in the planner: parameters equal transformers' own MoE models, total against active
parameters, what expert parallelism divides (experts' memory) and adds (all-to-alls, the busiest expert), the
search over ep, and one message per bad --ep."""

from __future__ import annotations

import json
import shlex
from dataclasses import replace
from pathlib import Path

import pytest

from pipetrain.cli.main import build_parser, main
from pipetrain.cli.plan import engine_has
from pipetrain.errors import ConfigError
from pipetrain.plan.experts import ep_cp_problem, ep_exchange_s, ep_extra_s, ep_problem, expert_layout, rank_parts
from pipetrain.plan.hardware import load_calibration, named_gpu, save_calibration
from pipetrain.plan.predict import Layout, predict, static_bytes
from pipetrain.plan.search import SearchSpace, enumerate_layouts
from pipetrain.plan.transformer import load_sizes, sizes_from_config

ROOT = Path(__file__).resolve().parents[2]
QWEN3_30B = ROOT / "benchmarks" / "models" / "qwen3-30b-a3b" / "config.json"
SMALL = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64)
MOE = {  # config class, keyword arguments: each MoE family the planner prices, with what changes its counts
    "qwen3_moe": ("Qwen3MoeConfig", dict(SMALL, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                                         num_experts_per_tok=2, mlp_only_layers=[1])),
    "qwen2_moe": ("Qwen2MoeConfig", dict(SMALL, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                                         num_experts_per_tok=2, shared_expert_intermediate_size=48)),
    "mixtral": ("MixtralConfig", dict(SMALL, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)),
    "olmoe": ("OlmoeConfig", dict(SMALL, intermediate_size=32, num_experts=4, num_experts_per_tok=2)),
    "gpt_oss": ("GptOssConfig", dict(SMALL, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                     head_dim=16)),
}


def _tiny(name: str = "qwen3_moe"):
    transformers = pytest.importorskip("transformers")
    cls, kwargs = MOE[name]
    return getattr(transformers, cls)(**kwargs)


@pytest.mark.parametrize("name", list(MOE))
def test_parameters_equal_transformers_own_moe_model(name, tmp_path):
    import torch
    transformers = pytest.importorskip("transformers")
    config = _tiny(name)
    config.save_pretrained(tmp_path)  # transformers writes its own field names (num_local_experts for qwen3_moe)
    sizes = load_sizes(tmp_path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert sizes.params() == model.num_parameters()
    for index, layer in enumerate(model.model.layers):
        mine = sizes.moe_layer_params() if sizes.is_moe(index) else sizes.layer_params()
        assert mine == sum(p.numel() for p in layer.parameters()), index
    blocks = sizes.blocks(32)
    assert sum(b.params for b in blocks) - (blocks[-1].params - sizes._norm() if sizes.tied else 0) == sizes.params()


def test_qwen3_30b_a3b_is_30_5_b_with_3_3_b_active():
    sizes = load_sizes(QWEN3_30B)  # its published config: "num_experts", as the hub's config.json spells it
    assert sizes.params() / 1e9 == pytest.approx(30.53, abs=0.01)
    # Qwen's own figure, 3.3 B activated, counts the embedding table too
    assert (sizes.flops_params() + sizes.embedding_params()) / 1e9 == pytest.approx(3.35, abs=0.01)
    assert sizes.routed_params() == 128 * 3 * 2048 * 768


def _layout(**kw) -> Layout:
    return Layout(**{**dict(dp=4, pp=1, batch=8, chunks=1, precision="bf16"), **kw})


def test_expert_parallelism_divides_the_experts_memory_and_reduction_group():
    blocks = sizes_from_config(_tiny().to_dict()).blocks(32)
    experts = sum(b.experts.params * 4.0 for b in blocks if b.experts)  # fp32 bytes of every routed expert
    dense = replace(_layout(), dp_mode="ddp", precision="fp32")
    whole = static_bytes(blocks, dense)
    parts, shares = rank_parts(blocks, 4)
    split = static_bytes(parts, dense) + static_bytes(shares, replace(dense, dp=1))
    # DDP over 4 replicas keeps 5 copies of every parameter; at ep=4 a rank holds a quarter of the experts, whose
    # gradients are reduced with no one (dp / ep = 1): weights, gradient and two moments, 4 copies
    assert whole - split == pytest.approx(5 * experts - 4 * experts / 4)


def test_all_to_alls_and_the_busiest_expert_cost_time_only_when_experts_are_split():
    blocks = sizes_from_config(_tiny().to_dict()).blocks(32)
    device, network = named_gpu("h100-sxm", "bf16")
    one = predict(blocks, _layout(), device, network)
    two = predict(blocks, _layout(ep=2), device, network)
    busy = predict(blocks, _layout(ep=2, moe_imbalance=1.5), device, network)
    assert max(two.memory_bytes) < max(one.memory_bytes)
    assert busy.step_s > two.step_s
    assert predict(blocks, _layout(moe_imbalance=1.5), device, network).step_s == pytest.approx(one.step_s)


def test_each_all_to_all_call_pays_the_calibrated_fixed_cost_per_peer(tmp_path):
    """A MoE block's forward makes three all-to-all calls (counts, tokens, outputs back), its backward two; each pays
    `Network.ep_all_to_all_s` per peer beyond the ring (exact to 1e-12 s); ep 1 pays nothing; an older calibration
    file (no such field) loads with 0 and a measured one round-trips."""
    blocks = sizes_from_config(_tiny().to_dict()).blocks(32)
    block = next(b for b in blocks if b.experts)
    device, network = named_gpu("h100-sxm", "bf16")
    fixed = replace(network, ep_all_to_all_s=1e-3)
    layout = _layout(ep=4)
    (forward, backward), (f_fixed, b_fixed) = (ep_exchange_s(block, 2, layout, n) for n in (network, fixed))
    assert f_fixed - forward == pytest.approx(3 * 3 * 1e-3, abs=1e-12)  # 3 calls x (ep - 1) peers
    assert b_fixed - backward == pytest.approx(2 * 3 * 1e-3, abs=1e-12)
    assert forward > backward > 0  # the counts' call is forward only
    assert ep_exchange_s(block, 2, _layout(), fixed) == (0.0, 0.0)
    assert predict(blocks, layout, device, fixed).step_s > predict(blocks, layout, device, network).step_s
    assert predict(blocks, _layout(), device, fixed).step_s == predict(blocks, _layout(), device, network).step_s
    old = load_calibration(ROOT / "tests" / "fixtures" / "cpu-calibration.json")
    assert old.network.ep_all_to_all_s == 0.0
    save_calibration(replace(old, network=replace(old.network, ep_all_to_all_s=4e-3)), tmp_path / "c.json")
    assert load_calibration(tmp_path / "c.json").network.ep_all_to_all_s == 4e-3


def test_hsdp_shards_the_experts_over_the_shard_group_divided_by_ep():
    """dp 8 in HSDP groups of 4 at ep 2: the experts' shards are cut over 4 / 2 = 2 ranks (replicated across the two
    groups), the dense part's over 4; an ep not dividing the shard group is refused in one line."""
    blocks = sizes_from_config(_tiny().to_dict()).blocks(32)
    hsdp = _layout(dp=8, batch=16, dp_mode="hsdp", dp_shard=4, precision="fp32", ep=2)
    assert expert_layout(hsdp).shards == 2 and expert_layout(replace(hsdp, dp_mode="fsdp", dp_shard=0)).shards == 4
    _, shares = rank_parts(blocks, 2)
    assert static_bytes(shares, expert_layout(hsdp)) == pytest.approx(
        static_bytes(shares, replace(hsdp, dp=2, dp_mode="fsdp", dp_shard=0, ep=1)))
    device, network = named_gpu("h100-sxm")
    assert predict(blocks, hsdp, device, network).step_s > 0
    assert ep_problem(blocks, 2, 8, 4) is None
    assert ep_problem(blocks, 4, 8, 2) == ("ep=4 does not divide the HSDP shard group dp_shard=2 (an EP group lies "
                                           "in one)")
    with pytest.raises(ConfigError, match="does not divide the HSDP shard group dp_shard=2"):
        predict(blocks, replace(hsdp, dp_shard=2, ep=4), device, network)


def test_the_search_tries_ep_where_it_divides_dp_and_refuses_it_elsewhere():
    blocks = sizes_from_config(_tiny().to_dict()).blocks(32)
    layouts = enumerate_layouts(len(blocks), 4, 8, SearchSpace(eps=(1, 2, 4), schedules=("gpipe", "1f1b"),
                                                               checkpoints=("never",), dp_modes=("fsdp",)))
    assert {(lay.dp, lay.ep) for lay in layouts} == {(4, 1), (4, 2), (4, 4), (2, 1), (2, 2), (1, 1)}
    assert ep_problem(blocks, 3) == "ep=3 does not divide the 4 experts of MoELayer0"
    dense = sizes_from_config(dict(SMALL, model_type="llama", intermediate_size=96)).blocks(32)
    assert "the model has none" in ep_problem(dense, 2)
    with pytest.raises(ConfigError, match="does not divide dp=1"):
        predict(blocks, _layout(dp=1, batch=2, ep=2), *named_gpu("h100-sxm"))


def test_ep_beside_cp_prices_a_cp_ranks_tokens_over_its_wider_group_at_pp1_tp1_only():
    """A cp rank sends its share of the tokens (stage_costs gives ep_extra_s the share); its EP group's ranks are a
    replica (cp ranks) apart, so at cp 2 a group of 2 spans 4 ranks and crosses 2-GPU nodes; pp or tp beside both is
    refused, as train refuses it."""
    blocks = sizes_from_config(_tiny().to_dict()).blocks(32)
    device, network = named_gpu("h100-sxm", "bf16")
    block = next(b for b in blocks if b.experts)
    inside = ep_extra_s(block, 2, _layout(dp=2, ep=2, cp=1, gpus_per_node=2), network, device)
    across = ep_extra_s(block, 2, _layout(dp=2, ep=2, cp=2, gpus_per_node=2), network, device)
    assert across[0] > inside[0] > 0
    assert predict(blocks, _layout(dp=2, batch=4, ep=2, cp=2), device, network).step_s > 0
    assert ep_cp_problem(_layout(dp=2, ep=2, cp=2)) is None
    assert "not HSDP" in ep_cp_problem(_layout(dp=4, ep=2, cp=2, dp_mode="hsdp", dp_shard=2))
    with pytest.raises(ConfigError, match="ep=2 beside cp=2 is built at pp 1 and tp 1 only, not pp=2 x tp=1"):
        predict(blocks, _layout(dp=2, pp=2, batch=4, ep=2, cp=2), device, network)
    layouts = enumerate_layouts(len(blocks), 8, 8, SearchSpace(eps=(1, 2), cps=(1, 2), schedules=("gpipe", "1f1b"),
                                                               checkpoints=("never",), dp_modes=("fsdp",)))
    assert {(lay.dp, lay.pp) for lay in layouts if lay.ep > 1 and lay.cp > 1} == {(4, 1)}  # not dp 2 x pp 2
    assert {(lay.dp, lay.pp) for lay in layouts if lay.ep == 1 and lay.cp > 1} >= {(4, 1), (2, 2)}


def _folder(tmp_path, config: dict) -> Path:
    folder = tmp_path / config["model_type"]
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_plan_of_a_moe_folder_prices_its_experts_and_chooses_ep(tmp_path, capsys):
    folder = _folder(tmp_path, _tiny().to_dict())
    assert main(["plan", "--model", str(folder), "--gpus", "4", "--gpu", "h100-sxm", "--seq-len", "32",
                 "--batch", "16", "--tp", "1", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "mixture of experts: " in out and "active per token (top 2 of 4 experts in 2 layers)" in out
    assert "2 MoE layers of" in out and "and 1 dense of" in out
    assert main(["plan", "--model", str(folder), "--gpus", "4", "--gpu", "h100-sxm", "--seq-len", "32",
                 "--batch", "16", "--tp", "1", "--pp", "1", "--ep", "4"]) == 0
    out = capsys.readouterr().out
    train = next(line for line in out.splitlines() if "pipetrain train" in line)
    assert "1/ep4" in out
    if engine_has("ep"):  # the train line carries --ep once train runs expert parallelism, and parses
        assert "--ep 4" in train
        build_parser().parse_args(shlex.split(train.strip())[1:])
    else:
        assert "--ep" not in train and "this pipetrain's train has no --ep" in out


@pytest.mark.parametrize("flags,message", [
    (["--ep", "3"], "--ep 3: ep=3 does not divide the 4 experts"),
    (["--moe-imbalance", "0.5"], "--moe-imbalance 0.5 is below 1"),
    (["--ep", "2", "--cp", "2", "--pp", "2"], "--ep 2 with --cp 2 and --pp 2 --tp 1: expert parallelism beside "
                                              "context parallelism is built at pp 1 and tp 1 only"),
])
def test_bad_expert_flags_are_one_line(flags, message, tmp_path, capsys):
    folder = _folder(tmp_path, _tiny().to_dict())
    assert main(["plan", "--model", str(folder), "--gpus", "4", "--seq-len", "32", "--batch", "16", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_ep_on_a_dense_model_is_one_line(tmp_path, capsys):
    folder = _folder(tmp_path, dict(SMALL, model_type="llama", intermediate_size=96))
    assert main(["plan", "--model", str(folder), "--gpus", "4", "--seq-len", "32", "--batch", "16", "--ep", "2"]) == 2
    err = capsys.readouterr().err
    assert "the model has none (a dense model)" in err and "drop --ep" in err


def test_layout_auto_searches_ep_for_a_moe_model_and_keeps_a_given_ep():
    from pipetrain.plan.auto import MARGIN, Fixed, choose_layout, layout_flags
    from pipetrain.plan.experts import expert_degrees

    qwen3 = load_sizes(QWEN3_30B).blocks(4096, element=2)
    assert expert_degrees(qwen3, 64) == (1, 2, 4, 8, 16, 32, 64) and expert_degrees(qwen3, 8) == (1, 2, 4, 8)
    assert expert_degrees([replace(b, experts=None) for b in qwen3], 64) == (1,)
    device, network = named_gpu("h100-sxm", "bf16")
    kw = dict(world=16, batch=32, device=device, network=network, gpus_per_node=8, precision="bf16")
    replicas = Fixed(pp=2, dp_mode="ddp")  # 8 whole replicas of each half: only ep divides the experts' memory
    best = choose_layout(qwen3, fixed=replicas, **kw).prediction
    assert best.layout.ep > 1 and best.layout.dp == 8
    flags = layout_flags(best)
    assert flags[flags.index("--ep") + 1] == str(best.layout.ep)
    assert choose_layout(qwen3, fixed=replace(replicas, ep=8), **kw).prediction.layout.ep == 8
    with pytest.raises(ConfigError, match="no layout of 16 ranks fits"):
        choose_layout(qwen3, fixed=replace(replicas, ep=1), **kw)
    small = choose_layout(qwen3[:4], **kw).prediction  # 3 layers: the experts fit unsplit
    unsplit = choose_layout(qwen3[:4], fixed=Fixed(ep=1), **kw).prediction
    assert small.layout.ep == 1 or small.step_s < unsplit.step_s / (1 + MARGIN)  # ep's all-to-alls only for a gain


def test_a_layers_rms_norms_keep_their_normalized_product_beside_their_input():
    """The norm term alone: transformers' RMSNorm keeps, beyond its input, `x * rsqrt(mean(x²))` (h per token,
    what its weight's gradient needs) and a per-token statistic; `norm_products` counts the first for the layer's
    two norms and its q/k norms (q + k), none for LayerNorm (statistics only)."""
    import torch
    pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    norm, x = Qwen3MoeRMSNorm(64), torch.randn(2, 16, 64, requires_grad=True)
    saved: dict[int, int] = {}

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() != norm.weight.untyped_storage().data_ptr():
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        norm(x)
    statistic = 2 * 16 * 4  # rsqrt(mean(x²)): one fp32 per token
    beyond_input = (sum(saved.values()) - x.numel() * 4 - statistic) / 2  # per sample
    sizes = sizes_from_config(_tiny().to_dict())  # hidden 64, q/k norms on heads of 16
    assert beyond_input == 16 * 4 * 64  # one normalized product per norm, at seq 16 and fp32
    assert sizes.norm_products(16, 4) == (2 * beyond_input + 16 * 4 * (sizes.q_width + sizes.kv_width),
                                          16 * 4 * (sizes.q_width + sizes.kv_width))
    assert replace(sizes, layer_norm=True).norm_products(16, 4) == (0.0, 0.0)


def test_a_moe_layers_planned_activations_equal_what_pipetrains_block_saves():
    """The whole MoE layer: the planner's per-sample activation bytes against what pipetrain's own block of a tiny
    Qwen3-MoE (fp32, SDPA, transformers' experts) saves for backward, counted by `profile_model` (each storage
    once, weights excluded). Tolerance 5 %: the router's integer routing indices (int64 per token and per routed
    pair, a few per cent at hidden 64) are not priced. Before the norms' products were counted: -15 %."""
    pytest.importorskip("transformers")
    from pipetrain.partition.measure import profile_model
    from pipetrain.workloads.hf.causal_lm import HFCausalLM

    config = _tiny()
    seq, samples = 32, 2
    profile = profile_model(HFCausalLM(config, seq_len=seq), samples, repeats=1, warmup=0)
    planned = sizes_from_config(config.to_dict()).blocks(seq, element=4)
    moe = [(b, p) for b, p in zip(planned, profile.blocks) if b.experts is not None]
    assert moe
    for block, measured in moe:
        assert block.activation_bytes * samples == pytest.approx(measured.activation_bytes, rel=0.05), block.name

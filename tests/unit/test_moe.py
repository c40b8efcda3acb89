"""Mixtures of experts without processes: folders read through transformers' conversion (per-expert files into the
fused layout, a rank reading only its own), each family's blocks chained by hand equal to transformers' model (logits,
load-balancing loss, the loss with it), the aux-loss mistakes the parity test catches, the expert counts (never
twice under recomputation), the bias balancing that moves, export as save_pretrained writes, bad input."""

from __future__ import annotations

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pipetrain.blocks import build_blocks, build_sequential  # noqa: E402
from pipetrain.checkpoint.experts import ExpertSlice, expert_slices  # noqa: E402
from pipetrain.errors import ConfigError  # noqa: E402
from pipetrain.lora import LoraBlocks, LoraSettings  # noqa: E402
from pipetrain.moe.adapters import adapter_wrappers, split_adapters  # noqa: E402
from pipetrain.moe.balance import DEFAULT_BIAS_RATE, ExpertBalancer, routed_blocks  # noqa: E402
from pipetrain.moe.experts import ExpertParallelExperts  # noqa: E402
from pipetrain.moe.split import check_expert_parallel, experts_in  # noqa: E402
from pipetrain.moe.router import RouterAuxLoss  # noqa: E402
from pipetrain.parallel.experts import expert_layout, is_expert, mark_expert  # noqa: E402
from pipetrain.pipeline.recompute import RecomputeWrapper  # noqa: E402
from pipetrain.workloads.hf import causal_lm as hf_causal_lm  # noqa: E402
from pipetrain.workloads.hf.causal_lm import HFCausalLM, causal_lm_loss  # noqa: E402
from pipetrain.workloads.hf.checkpoint import HFCheckpoint  # noqa: E402
from pipetrain.workloads.hf.export import hf_state_dict, write_folder  # noqa: E402
from pipetrain.workloads.hf.families import FAMILIES, MOE_FAMILIES  # noqa: E402
from tests.moe_folders import AUX_COEF, SEQ, VOCAB, moe_configs, moe_folder  # noqa: E402

RTOL, ATOL = 1e-5, 4e-5


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """model type -> (folder, the transformers model loaded from it by from_pretrained)."""
    root = tmp_path_factory.mktemp("moe-unit")
    out = {}
    for name in moe_configs():
        moe_folder(root / name, name)
        out[name] = (root / name, transformers.AutoModelForCausalLM.from_pretrained(root / name))
    return out


def _ids(batch: int = 3) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(0))


def test_every_moe_family_is_described():
    assert set(MOE_FAMILIES) == {"qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss"}
    assert all(FAMILIES[name] is family for name, family in MOE_FAMILIES.items())


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_per_expert_files_are_read_into_transformers_fused_layout(name, folders):
    folder, reference = folders[name]
    stored = json.loads((folder / "model.safetensors").read_bytes()[8:8 + int.from_bytes(
        (folder / "model.safetensors").read_bytes()[:8], "little")])
    assert any(".experts.0." in key for key in stored)  # on disk: one tensor per expert
    checkpoint = HFCheckpoint(folder, reference.config)
    for param in ("gate_up_proj", "down_proj"):
        key = f"model.layers.1.mlp.experts.{param}"
        torch.testing.assert_close(checkpoint.tensor(key), reference.get_parameter(key), rtol=0, atol=0)
        assert checkpoint.shapes()[key] == list(reference.get_parameter(key).shape)


def test_a_rank_reads_only_the_experts_of_its_own_layers(folders, monkeypatch):
    folder, _ = folders["mixtral"]
    model = HFCausalLM.from_folder(folder, seq_len=SEQ)
    read: list[str] = []
    original = hf_causal_lm._Checkpoint.read
    monkeypatch.setattr(hf_causal_lm._Checkpoint, "read", lambda self, key: read.append(key) or original(self, key))
    build_blocks(model, [3, 4], seed=0)  # decoder layers 2 and 3
    assert any("block_sparse_moe.experts.0.w1" in key for key in read)
    assert read and all(key.startswith(("model.layers.2.", "model.layers.3.")) for key in read), read


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_an_expert_parallel_rank_reads_only_its_own_experts(name, folders, monkeypatch):
    folder, reference = folders[name]
    model = HFCausalLM.from_folder(folder, seq_len=SEQ)
    experts = reference.get_parameter("model.layers.1.mlp.experts.gate_up_proj").shape[0]
    model.keep_experts(1, 2)  # rank 1 of ep 2: the second half
    read: list[str] = []
    original = hf_causal_lm._Checkpoint.read
    monkeypatch.setattr(hf_causal_lm._Checkpoint, "read", lambda self, key: read.append(key) or original(self, key))
    block = build_blocks(model, [2], seed=0)[0]  # decoder layer 1
    indices = {int(key.split(".experts.")[1].split(".")[0]) for key in read if ".experts." in key}
    assert indices == set(range(experts // 2, experts)), read
    mine = slice(experts // 2, experts)
    for param in ("gate_up_proj", "down_proj"):
        theirs = reference.get_parameter(f"model.layers.1.mlp.experts.{param}")
        ours = next(p for n, p in block.named_parameters() if n.endswith(f"experts.{param}"))
        torch.testing.assert_close(ours[mine], theirs[mine], rtol=0, atol=0)
        assert not ours[: experts // 2].any()  # never read: dropped by the split


GPT_OSS_EXPERTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def test_gpt_oss_experts_under_ep_keep_their_biases_in_reads_and_checkpoint_keys(folders):
    """GPT-OSS's experts split by --ep: accepted; rank 1 of ep 2 holds transformers' rows of every expert tensor
    (biases too); the split keeps all four under their names, each a checkpoint expert slice."""
    folder, reference = folders["gpt_oss"]
    model = HFCausalLM.from_folder(folder, seq_len=SEQ)
    check_expert_parallel(model, 2)  # once refused: "has another layout"
    experts = reference.get_parameter("model.layers.1.mlp.experts.gate_up_proj").shape[0]
    model.keep_experts(1, 2)
    block = build_blocks(model, [2], seed=0)[0]  # decoder layer 1
    mine = slice(experts // 2, experts)
    for param in GPT_OSS_EXPERTS:
        theirs = reference.get_parameter(f"model.layers.1.mlp.experts.{param}")
        ours = next(p for n, p in block.named_parameters() if n.endswith(f"experts.{param}"))
        torch.testing.assert_close(ours[mine], theirs[mine], rtol=0, atol=0)
    ((_, module),) = list(experts_in(block))
    container = torch.nn.Module()
    container.experts = ExpertParallelExperts(module, None)
    assert [n for n, _ in container.experts.named_parameters()] == list(GPT_OSS_EXPERTS)
    for param in container.experts.parameters():  # as the split marks them
        mark_expert(param)
    assert expert_slices(container, lambda key: key) == {
        f"experts.{name}": ExpertSlice(param.shape) for name, param in container.experts.named_parameters()}


@pytest.mark.parametrize("name", sorted(moe_configs()))
def test_each_moe_family_gives_transformers_logits_and_load_balancing_loss(name, folders):
    folder, reference = folders[name]
    model = HFCausalLM.from_folder(folder, seq_len=SEQ)
    x = _ids()
    expected = reference(input_ids=x, labels=x, output_router_logits=True)
    out = build_sequential(model, seed=0)(x)
    loss = model.loss()
    if name == "deepseek_v3":  # transformers adds no load-balancing loss for it: balanced by the bias
        assert expected.aux_loss is None and loss is causal_lm_loss
        torch.testing.assert_close(out, expected.logits, rtol=RTOL, atol=ATOL)
        return
    logits, aux = out
    torch.testing.assert_close(logits, expected.logits, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(aux, expected.aux_loss.expand(3), rtol=RTOL, atol=ATOL)
    assert isinstance(loss, RouterAuxLoss) and loss.coef == AUX_COEF
    torch.testing.assert_close(loss.total(out, x) / loss.count(x), expected.loss, rtol=RTOL, atol=ATOL)


def _router_grads(reference, x, aux_layers: slice | None, scale: float) -> torch.Tensor:
    """The routers' gradients of transformers' cross-entropy + scale x coef x the aux loss of `aux_layers`."""
    module = __import__(type(reference).__module__, fromlist=["load_balancing_loss_func"])
    reference.zero_grad()
    out = reference(input_ids=x, labels=x, output_router_logits=True)
    loss = out.loss - AUX_COEF * out.aux_loss  # the cross-entropy alone
    if aux_layers is not None:
        config = reference.config
        aux = module.load_balancing_loss_func(out.router_logits[aux_layers], config.num_experts,
                                              config.num_experts_per_tok)
        loss = loss + scale * AUX_COEF * aux
    loss.backward()
    return torch.cat([p.grad.flatten() for n, p in reference.named_parameters() if n.endswith("mlp.gate.weight")])


def test_the_parity_tolerance_catches_an_aux_loss_dropped_doubled_or_from_one_stage(folders):
    _, reference = folders["qwen3_moe"]
    x = _ids()
    right = _router_grads(reference, x, slice(None), 1.0)
    last_stage = slice(1, None)  # pp=2 of 4 layers: the routers of layers 2 and 3 (layer 0 is dense)
    for wrong in (_router_grads(reference, x, None, 1.0), _router_grads(reference, x, slice(None), 2.0),
                  _router_grads(reference, x, last_stage, 1.0)):
        assert (wrong - right).abs().max() > 10 * (ATOL + RTOL * right.abs().max())  # 10x the parity tolerance


def _deepseek_layers(folder) -> tuple[HFCausalLM, list]:
    model = HFCausalLM.from_folder(folder, seq_len=SEQ)
    return model, build_blocks(model, range(model.num_blocks), seed=0)


def test_expert_counts_once_per_token_even_when_recomputed(folders):
    model, blocks = _deepseek_layers(folders["deepseek_v3"][0])
    stage = torch.nn.Sequential(*blocks)
    wrapper = RecomputeWrapper(stage, "always")
    wrapper.start_step(1)
    wrapper.train()
    x = _ids()
    wrapper(x).sum().backward()  # the forward again inside the backward: not counted
    routed = routed_blocks([stage])
    assert len(routed) == 3  # layer 0 is dense (first_k_dense_replace)
    for block in routed:
        assert block.tokens_per_expert.sum().item() == x.numel() * model.config.num_experts_per_tok


def test_deepseek_bias_moves_against_the_load_after_a_step(folders):
    _, blocks = _deepseek_layers(folders["deepseek_v3"][0])
    routed = routed_blocks(blocks)
    before = [b.balancing_bias().clone() for b in routed]
    for block in blocks:
        block.train()
    torch.nn.Sequential(*blocks)(_ids())
    loads = [b.tokens_per_expert.clone() for b in routed]
    imbalance = ExpertBalancer(routed).after_step()
    assert set(imbalance) == {1, 2, 3} and all(ratio >= 1.0 for ratio in imbalance.values())
    for block, old, load in zip(routed, before, loads):
        moved = block.balancing_bias() - old
        torch.testing.assert_close(moved, DEFAULT_BIAS_RATE * torch.sign(load.mean() - load))
        assert moved.abs().max() > 0 and block.tokens_per_expert is None  # it moved; the counts start again


def test_no_bias_moves_without_training_forwards(folders):
    _, blocks = _deepseek_layers(folders["deepseek_v3"][0])
    routed = routed_blocks(blocks)
    before = [b.balancing_bias().clone() for b in routed]
    with torch.no_grad():
        torch.nn.Sequential(*blocks).eval()(_ids())
    assert ExpertBalancer(routed).after_step() == {}
    assert all(torch.equal(b.balancing_bias(), old) for b, old in zip(routed, before))


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3"])
def test_export_writes_what_save_pretrained_writes(name, folders, tmp_path):
    folder, reference = folders[name]
    model = HFCausalLM.from_folder(folder, seq_len=SEQ)
    weights = {f"{index}.{local}": value for index in range(model.num_blocks)
               for local, value in model.build_block(index).state_dict().items()}
    hf_model = transformers.AutoModelForCausalLM.from_config(model.config)
    hf_model.load_state_dict(hf_state_dict(weights, model))
    out = write_folder(hf_model, tmp_path / "out")
    assert set(HFCheckpoint(out).files) == set(HFCheckpoint(folder).files)  # per expert, as the source folder
    again = transformers.AutoModelForCausalLM.from_pretrained(out)
    x = _ids()
    torch.testing.assert_close(again(input_ids=x).logits, reference(input_ids=x).logits, rtol=RTOL, atol=ATOL)


def test_a_mixture_of_experts_without_a_description_names_what_is_missing():
    config = transformers.PhimoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)
    with pytest.raises(ConfigError, match=r"'phimoe': a mixture of experts \(num_local_experts=4\) with no "
                                          "description") as err:
        HFCausalLM(config, seq_len=SEQ)
    assert "experts' count field (num_local_experts)" in err.value.message and "families/moe.py" in err.value.hint


def test_partition_by_parameters_prices_the_experts(folders):
    from pipetrain.config import PipelineConfig
    from pipetrain.partition import parameter_costs, resolve_balance

    model = HFCausalLM.from_folder(folders["deepseek_v3"][0], seq_len=SEQ)
    costs = parameter_costs(model)  # embedding, a dense layer, three MoE layers (8 experts each), head
    assert costs[1] < costs[2] == costs[3] == costs[4]
    balance = resolve_balance(model, PipelineConfig(pp=3, partition="parameters"))
    assert balance != resolve_balance(model, PipelineConfig(pp=3))  # not the uniform [2, 2, 2]: the experts weigh
    assert sum(balance) == model.num_blocks


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
def test_tensor_parallelism_splits_the_attention_and_keeps_the_moe_block_whole(name):
    plan = MOE_FAMILIES[name].layer_tp_plan(moe_configs()[name], 2)
    assert {"layer.self_attn.q_proj", "layer.self_attn.o_proj"} <= set(plan)
    assert not [key for key in plan if key.startswith("layer.mlp")], plan  # router and experts whole on every rank
    with pytest.raises(ConfigError, match="tp=4 does not divide the model's num_key_value_heads=2"):
        MOE_FAMILIES[name].layer_tp_plan(moe_configs()[name], 4)


@pytest.mark.parametrize("name", ["deepseek_v3", "gpt_oss"])
def test_tensor_parallelism_is_refused_where_a_moe_family_has_no_plan(name):
    from pipetrain.workloads.hf.tp import hf_tp_plan

    with pytest.raises(ConfigError, match=f"the Hugging Face {name} model has no tensor-parallel plan"):
        hf_tp_plan(moe_configs()[name], MOE_FAMILIES[name], 1, 6, 2)


EXPERT_TARGETS = ("experts.gate_up_proj", "experts.down_proj")


@pytest.mark.parametrize(("name", "ep"), [("qwen3_moe", 2), ("qwen3_moe", 8), ("gpt_oss", 2)])
def test_split_expert_adapters_are_each_rank_s_experts_of_peft_s_update(name, ep, folders):
    """PEFT's adapters of the fused experts (A [r x E, in], B [out, r x E]) split over `ep` ranks: each rank's factors
    give exactly its experts' rows of PEFT's whole update, in both of PEFT's paths (its factors, its delta weight;
    one expert a rank, its delta weight only, [out, in], added to the [1, out, in] expert as PEFT adds it), and are
    marked as expert slices (A by rows, B by columns in r blocks)."""
    model = LoraBlocks(HFCausalLM.from_folder(folders[name][0], seq_len=SEQ),
                       LoraSettings(rank=2, init=False, targets=EXPERT_TARGETS))
    torch.manual_seed(0)
    block = model.build_block(2)
    ((experts_name, experts),) = list(experts_in(block))
    wrappers = adapter_wrappers(block, experts_name)
    assert [w.parameter_name for w in wrappers] == ["down_proj", "gate_up_proj"]
    total = experts.gate_up_proj.shape[0]
    local = total // ep
    for wrapper in wrappers:
        whole = wrapper.get_delta_weight("default")
        assert whole.shape == getattr(experts, wrapper.parameter_name).shape
        for rank in range(ep):
            part = copy.deepcopy(wrapper)
            split_adapters(part, rank * local, local)
            mine = whole[rank * local:(rank + 1) * local]
            base = getattr(experts, wrapper.parameter_name).detach()[rank * local:(rank + 1) * local]
            torch.testing.assert_close(base + part.get_delta_weight("default"), base + mine, rtol=0, atol=1e-6)
            if local > 1:
                lhs, rhs, scaling = part.get_delta_factors("default")
                torch.testing.assert_close(scaling * lhs @ rhs, mine, rtol=0, atol=1e-6)
            a, b = part.lora_A["default"].weight, part.lora_B["default"].weight
            assert part.num_experts == local and is_expert(a) and is_expert(b)
            assert expert_layout(a) == (0, 1) and expert_layout(b) == (1, 2)


def test_adapters_on_split_experts_are_refused_where_they_cannot_be_split(folders):
    """--ep with adapters on the experts: accepted under DDP; under FSDP2, and with one transposed expert a rank
    (GPT-OSS's 4 at ep 4), one ConfigError each."""
    settings = LoraSettings(rank=2, targets=("q_proj",) + EXPERT_TARGETS)
    qwen = LoraBlocks(HFCausalLM.from_folder(folders["qwen3_moe"][0], seq_len=SEQ), settings)
    check_expert_parallel(qwen, 2)
    check_expert_parallel(qwen, 8)
    with pytest.raises(ConfigError, match=r"--ep 2 --dp-mode fsdp with LoRA adapters on the experts "
                                          r"\(layer.mlp.experts\): FSDP2 does not gather"):
        check_expert_parallel(qwen, 2, dp_mode="fsdp")
    gpt = LoraBlocks(HFCausalLM.from_folder(folders["gpt_oss"][0], seq_len=SEQ), settings)
    check_expert_parallel(gpt, 2)
    with pytest.raises(ConfigError, match=r"--ep 4 leaves one expert a rank, and PEFT adapts a lone transposed "
                                          r"expert \(GptOssExperts, layer.mlp.experts\) the wrong way round"):
        check_expert_parallel(gpt, 4)

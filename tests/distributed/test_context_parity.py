"""Context parallelism: a tiny Llama (and GPT-2) with each sequence cut over 2 or 4 ranks equals the unsplit
transformers model on the same tokens.

One spawned job of 4 ranks runs every case in turn: ring attention at cp 4, cp 2 x pp 2 (1F1B, with and without
recomputation; interleaved 1F1B, 2 stages per rank) and cp 2 x dp 2 (DDP, FSDP2, HSDP); all-to-all attention at
cp 2 x pp 2 and cp 2 x dp 2 (FSDP2); cp 2 x tp 2 (FSDP2
over the cp ranks; ring for the Llama, whose 2 key/value heads leave 1 per tp rank, all-to-all for GPT-2; the Llama's
with --sequence-parallel beside cp, and with --loss-parallel too: 1/(cp*tp) of each sequence between the TP regions,
the logits of the cp part split over the vocabulary; all-to-all for a Llama with 4 key/value heads, 2 per tp rank,
with and without both); packed documents
of unequal lengths crossing the parts' boundaries under both attentions (the reference: transformers' packed-sequence
mask from `position_ids`, so a document that saw another would change the loss and gradients); the split-backward
schedules (zero-bubble, zbv with recomputation, dualpipev with packed documents; all-to-all under zbv) at cp 2 x pp 2
over FSDP2; ring cp 2 x pp 2 with recomputation and packed documents of which one starts at every row's last
zig-zag part, so that rank 0's second ring step is wholly masked (no block computed, its exchanges still run). Over
three SGD steps
(a full batch, a right-padded one, one smaller than the micro-batch count) the loss on every rank, every gradient of
every step and every final parameter equal the transformers model's within rtol 1e-5, atol 4e-5. The checkpoint
of cp 2 x pp 2 then loads at cp 4 (checkpoints are layout-free: cp does not split parameters).

Mixtures of experts beside context parallelism, in the same job: Qwen3-MoE (the load-balancing loss on) at
dp 2 x ep 2 x cp 2 (pp 1) under ring attention (DDP) and all-to-all attention (FSDP2), and DeepSeek-V3 (its
balancing bias choosing the experts) under the ring, each cp rank routing its part of the sequences to the experts
of its cp coordinate's ep pair, and Qwen3-MoE at ring cp 2 x pp 2 (ep 1), against transformers' unsplit model per
micro-batch (test_moe_parity's reference): losses, every gradient and the final parameters of two SGD steps,
rtol 1e-5 / atol 4e-5; DeepSeek-V3's tokens per expert summed over the dp x cp ranks move the bias as the unsplit
model's counts do.

In the same job: PEFT's LoRA adapters at ring cp 2 x pp 2 against `peft.get_peft_model` on the unsplit model (same
fp32 tolerance), and bf16 autocast at ring and all-to-all cp 2 x pp 2 against the unsplit model under bf16 autocast
(twice the bf16 budget of tests/tolerances.py; the ring's blocks run torch's fused kernel on the bf16 inputs,
accumulating in fp32, merged in fp32).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from torch.distributed.tensor import DTensor  # noqa: E402

from pipetrain.checkpoint.folders import read_meta  # noqa: E402
from pipetrain.checkpoint.state import find_checkpoint, load_checkpoint, save_checkpoint  # noqa: E402
from pipetrain.config import ParallelConfig, PipelineConfig  # noqa: E402
from pipetrain.context.attention import ContextMask  # noqa: E402
from pipetrain.context.layout import zigzag_index, zigzag_split  # noqa: E402
from pipetrain.launch.env import free_port  # noqa: E402
from pipetrain.launch.spawn import RankSpec, spawn  # noqa: E402
from pipetrain.lora import LoraBlocks  # noqa: E402
from pipetrain.recipe import param_groups  # noqa: E402
from pipetrain.session import build_session, close_session, join_job  # noqa: E402
from pipetrain.workloads.hf.causal_lm import HFCausalLM, causal_lm_loss  # noqa: E402
from pipetrain.moe.balance import DEFAULT_BIAS_RATE  # noqa: E402
from pipetrain.parallel.experts import is_expert  # noqa: E402
from pipetrain.train.loop import expert_balancer  # noqa: E402
from pipetrain.workloads.hf.families import family_of  # noqa: E402
from pipetrain.workloads.hf.routing import num_experts  # noqa: E402
from tests.distributed import test_moe_parity as moe_parity  # noqa: E402
from tests.distributed.test_hf_parity import VOCAB, _full, compare_records, make_batches, tiny_configs  # noqa: E402
from tests.moe_folders import SEQ as MOE_SEQ, moe_folder  # noqa: E402
from tests.distributed.test_lora_parity import LR as LORA_LR, MOMENTUM, SETTINGS, peft_reference  # noqa: E402
from tests.hf_folders import transformers_names  # noqa: E402
from tests.tolerances import U, budget, forward_stages  # noqa: E402

SEED, LR, SEQ = 0, 0.5, 16
#: case -> (family, dp, dp mode, pp, tp, cp, attention, schedule, recomputation, packed documents)
CASES = {
    "llama-ring-cp4": ("llama", 1, "ddp", 1, 1, 4, "ring", "gpipe", "never", False),
    "llama-ring-cp2xpp2": ("llama", 1, "ddp", 2, 1, 2, "ring", "1f1b", "never", False),
    "llama-ring-cp2xpp2-recompute": ("llama", 1, "ddp", 2, 1, 2, "ring", "1f1b", "always", False),
    "llama-ring-cp2xpp2-interleaved": ("llama", 1, "ddp", 2, 1, 2, "ring", "interleaved-1f1b", "never", False),
    "llama-ring-cp2xdp2": ("llama", 2, "ddp", 1, 1, 2, "ring", "gpipe", "never", False),
    "llama-ulysses-cp2xpp2": ("llama", 1, "ddp", 2, 1, 2, "ulysses", "1f1b", "never", False),
    "llama-ulysses-cp2xdp2-fsdp": ("llama", 2, "fsdp", 1, 1, 2, "ulysses", "gpipe", "never", False),
    "llama-ring-cp2xpp2-documents": ("llama", 1, "ddp", 2, 1, 2, "ring", "1f1b", "never", True),
    "llama-ring-cp4-documents": ("llama", 1, "ddp", 1, 1, 4, "ring", "gpipe", "never", True),
    "llama-ulysses-cp2xdp2-documents": ("llama", 2, "ddp", 1, 1, 2, "ulysses", "gpipe", "never", True),
    "gpt2-ring-cp2xpp2": ("gpt2", 1, "ddp", 2, 1, 2, "ring", "1f1b", "never", False),
    "llama-ring-cp2xdp2-fsdp": ("llama", 2, "fsdp", 1, 1, 2, "ring", "gpipe", "never", False),
    # HSDP: shard groups of one data replica's 2 cp ranks, the 2 replicas' groups replicated (--dp-shard 1)
    "llama-ring-cp2xdp2-hsdp": ("llama", 2, "hsdp", 1, 1, 2, "ring", "gpipe", "never", False),
    "llama-ulysses-cp2xdp2": ("llama", 2, "ddp", 1, 1, 2, "ulysses", "gpipe", "never", False),
    "llama-ring-cp2xtp2-fsdp": ("llama", 1, "fsdp", 1, 2, 2, "ring", "gpipe", "never", False),
    "gpt2-ulysses-cp2xtp2-fsdp": ("gpt2", 1, "fsdp", 1, 2, 2, "ulysses", "gpipe", "never", False),
    # 4 key/value heads leave 2 per tp rank: all-to-all at cp2 x tp2 for a Llama (and its sequence parallelism)
    "llama-mha-ulysses-cp2xtp2-fsdp": ("llama-mha", 1, "fsdp", 1, 2, 2, "ulysses", "gpipe", "never", False),
    # the split-backward schedules (input gradients, then weight gradients): FSDP2 over the cp ranks, as with dp
    "llama-ring-cp2xpp2-zero-bubble-fsdp": ("llama", 1, "fsdp", 2, 1, 2, "ring", "zero-bubble", "never", False),
    "llama-ring-cp2xpp2-zbv-fsdp": ("llama", 1, "fsdp", 2, 1, 2, "ring", "zbv", "always", False),
    "llama-ring-cp2xpp2-dualpipev-fsdp": ("llama", 1, "fsdp", 2, 1, 2, "ring", "dualpipev", "never", True),
    "llama-ulysses-cp2xpp2-zbv-fsdp": ("llama", 1, "fsdp", 2, 1, 2, "ulysses", "zbv", "never", False),
    # a document starts at every row's last part: rank 0's second ring step is wholly masked (skipped, exchanged)
    "llama-ring-cp2xpp2-recompute-boundary": ("llama", 1, "ddp", 2, 1, 2, "ring", "1f1b", "always", "boundary"),
}

#: the token where every row of the "boundary" documents starts a document: the first of cp 2's last zig-zag part
BOUNDARY = 3 * SEQ // 4

#: cases on a layout of CASES beyond full fp32 training: case -> (layout case, "lora", "bf16", or "sp" (sequence
#: parallelism beside cp: 1/(cp*tp) of each sequence between the TP regions) with "-lp" (loss parallelism too))
VARIANTS = {
    "llama-ring-cp2xtp2-fsdp-sp": ("llama-ring-cp2xtp2-fsdp", "sp"),
    "llama-ring-cp2xtp2-fsdp-sp-lp": ("llama-ring-cp2xtp2-fsdp", "sp-lp"),
    "llama-mha-ulysses-cp2xtp2-fsdp-sp-lp": ("llama-mha-ulysses-cp2xtp2-fsdp", "sp-lp"),
    "llama-ring-cp2xpp2-lora": ("llama-ring-cp2xpp2", "lora"),
    "llama-ring-cp2xpp2-bf16": ("llama-ring-cp2xpp2", "bf16"),
    "llama-ulysses-cp2xpp2-bf16": ("llama-ulysses-cp2xpp2", "bf16"),
}

#: the case whose checkpoint is loaded at another cp
RESUMED = "llama-ring-cp2xpp2"

#: mixtures of experts beside context parallelism (test_moe_parity's 4 micro-batches per replica): case -> (MoE
#: family of tests/moe_folders.py, attention, dp mode, dp, ep, pp, cp, expert capacity). dp 2 x ep 2 x cp 2 splits the
#: experts (under FSDP2 sharded over the flattened (expert-data-parallel, cp) mesh); cp 2 x pp 2 (1F1B, ep 1) carries
#: the router statistics across the stage boundary before the cp pair sums them
MOE_CASES = {
    "qwen3_moe-ring-dp2xep2xcp2": ("qwen3_moe", "ring", "ddp", 2, 2, 1, 2, None),
    "qwen3_moe-ulysses-dp2xep2xcp2-fsdp": ("qwen3_moe", "ulysses", "fsdp", 2, 2, 1, 2, None),
    "deepseek_v3-ring-dp2xep2xcp2": ("deepseek_v3", "ring", "ddp", 2, 2, 1, 2, None),
    "qwen3_moe-ring-cp2xpp2": ("qwen3_moe", "ring", "ddp", 1, 1, 2, 2, None),
}
#: an expert capacity that drops slots (factor 0.5), at dp 2 x ep 2 x cp 2 and on whole sequences (dp 2 x ep 2 x pp 2,
#: the same micro-batches): transformers has no capacity, so the cut run is compared with the whole one
CAPACITY_CASES = {
    "qwen3_moe-capacity-dp2xep2xcp2": ("qwen3_moe", "ring", "ddp", 2, 2, 1, 2, 0.5),
    "qwen3_moe-capacity-dp2xep2xpp2": ("qwen3_moe", "ring", "ddp", 2, 2, 2, 1, 0.5),
}


def document_positions(n: int, seed: int, boundary: int | None = None) -> torch.Tensor:
    """Per-row positions of packed documents of unequal lengths (1 to 9 tokens), restarting at each document (and
    at `boundary`, when given)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        row: list[int] = []
        for end in ([boundary, SEQ] if boundary else [SEQ]):
            while len(row) < end:
                row += range(int(torch.randint(1, 10, (1,), generator=gen)))
            row = row[:end]
        rows.append(row)
    return torch.tensor(rows)


def batches(dp: int, documents: bool | str) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """test_hf_parity's batches (inputs as a tuple), with per-document positions when `documents` (a document
    starting at `BOUNDARY` in every row too when "boundary")."""
    out = []
    boundary = BOUNDARY if documents == "boundary" else None
    for step, (ids, labels) in enumerate(make_batches(dp)):
        out.append(((ids, document_positions(ids.shape[0], step, boundary)) if documents else (ids,), labels))
    return out


def reference(model: torch.nn.Module, dp: int, documents: bool, precision: str = "fp32") -> dict:
    """The unsplit transformers model's three SGD steps (under bf16 autocast for `precision` "bf16")."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    for inputs, labels in batches(dp, documents):
        opt.zero_grad()
        # packed: transformers masks by document from the positions only without a cache (use_cache=False)
        extra = {"position_ids": inputs[1], "use_cache": False} if documents else {}
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = model(input_ids=inputs[0], labels=labels, **extra).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _train(folder: str, case: str, device: torch.device, save: Path | None = None, variant: str = "") -> dict:
    """One case's three steps; `variant` "lora" (PEFT's adapters, SGD with momentum, the adapters trained) or
    "bf16" (bf16 autocast, fp32 weights)."""
    _, dp, dp_mode, pp, tp, cp, attention, schedule, recompute, documents = CASES[case]
    model = HFCausalLM.from_folder(folder, seq_len=SEQ, documents=bool(documents))
    if variant == "lora":
        model = LoraBlocks(model, SETTINGS)
    pipeline = PipelineConfig(pp=pp, schedule=schedule, n_microbatches=4, checkpoint=recompute)
    parallel = ParallelConfig(dp=dp, dp_mode=dp_mode, pipeline=pipeline, tp=tp, cp=cp, cp_attention=attention,
                              dp_shard=1 if dp_mode == "hsdp" else None, sequence_parallel=variant.startswith("sp"),
                              loss_parallel=variant.endswith("-lp"))
    session = build_session(model, parallel, device, seed=SEED, loss_fn=causal_lm_loss,
                            precision="bf16" if variant == "bf16" else "fp32")
    engine, replica = session.engine, session.mesh.dp_rank
    keys = transformers_names(model)
    opt = (torch.optim.SGD(param_groups(engine, 0.0), lr=LORA_LR, momentum=MOMENTUM) if variant == "lora" else
           torch.optim.SGD(engine.parameters(), lr=LR))
    trained = [(n, p) for n, p in engine.named_parameters() if p.requires_grad]
    losses, grads, evaluated = [], [], None
    for inputs, labels in batches(dp, documents):
        share = slice(replica * labels.shape[0] // dp, (replica + 1) * labels.shape[0] // dp)
        if variant.startswith("sp") and evaluated is None:  # the first batch's loss before training, evaluated
            evaluated = engine.evaluate(tuple(t[share] for t in inputs), labels[share]).loss
        opt.zero_grad()
        losses.append(engine.step(tuple(t[share] for t in inputs), labels[share]).loss)
        grads.append([(keys[n], _full(p.grad).clone()) for n, p in trained])
        opt.step()
    params = [(keys[n], _full(p.detach()).clone()) for n, p in trained]
    held = {keys[n]: (p.to_local().numel(), p.numel()) for n, p in trained if isinstance(p, DTensor)}
    if save is not None:
        save_checkpoint(save, engine, opt, step=3, model_name="llama")
    return {"losses": losses, "grads": grads, "params": params, "held": held, "evaluated": evaluated}


def _train_moe(folder: str, case: str, device: torch.device) -> dict:
    """Two SGD steps of a MoE folder in a layout of `MOE_CASES` (expert slices gathered whole); the rank's expert
    parameters, and each routed layer's balancing bias (None without) after the expert balancer's step over the
    counts of both steps."""
    _, attention, dp_mode, dp, ep, pp, cp, capacity = {**MOE_CASES, **CAPACITY_CASES}[case]
    model = HFCausalLM.from_folder(folder, seq_len=MOE_SEQ).with_capacity(capacity)
    pipeline = PipelineConfig(pp=pp, schedule="gpipe" if pp == 1 else "1f1b", n_microbatches=moe_parity.CHUNKS)
    parallel = ParallelConfig(dp=dp, ep=ep, cp=cp, cp_attention=attention, dp_mode=dp_mode, pipeline=pipeline)
    session = build_session(model, parallel, device, seed=moe_parity.SEED, loss_fn=model.loss())
    record = moe_parity._steps(session.engine, model, dp, session.mesh.dp_rank, gather=True)
    record["split"] = sum(is_expert(p) for p in session.engine.parameters())
    balancer = expert_balancer(session.engine, session.mesh)
    record["imbalance"] = balancer.after_step()
    record["biases"] = {block.index: None if block.balancing_bias() is None else block.balancing_bias().clone()
                        for block in balancer.blocks}
    record["dropped"] = balancer.dropped  # layer -> (slots dropped by the capacity, slots routed), both steps
    return record


def moe_reference(model: torch.nn.Module, dp: int) -> dict:
    """test_moe_parity's reference of `model` for `dp` replicas, with each routed layer's load imbalance (max / mean
    tokens per expert: the experts its router chose in both steps) and its balancing bias moved by those counts as
    `ExpertBalancer` moves it (None without a bias)."""
    family = family_of(model.config)
    router_class, _ = family.router_class()
    experts = num_experts(model.config, family)
    routers = {int(name.split(".layers.")[1].split(".")[0]): module for name, module in model.named_modules()
               if isinstance(module, router_class)}
    before = {index: getattr(router, family.router_bias or "", None) for index, router in routers.items()}
    before = {index: None if bias is None else bias.detach().clone() for index, bias in before.items()}
    counts = {index: torch.zeros(experts) for index in routers}

    def counter(index: int):
        def count(_module, _args, out) -> None:
            counts[index] += torch.bincount(out[-1].flatten(), minlength=experts)
        return count

    hooks = [router.register_forward_hook(counter(index)) for index, router in routers.items()]
    out = moe_parity.reference(model, dp)
    for hook in hooks:
        hook.remove()
    out["imbalance"] = {index: (load.max() / load.mean()).item() for index, load in counts.items()}
    out["biases"] = {index: None if bias is None else
                     bias + DEFAULT_BIAS_RATE * torch.sign(counts[index].mean() - counts[index])
                     for index, bias in before.items()}
    return out


def _resumed(folder: str, saved: Path, device: torch.device) -> list:
    """The parameters of a checkpoint written at cp 2 x pp 2, loaded at cp 4 (pp 1)."""
    model = HFCausalLM.from_folder(folder, seq_len=SEQ)
    parallel = ParallelConfig(pipeline=PipelineConfig(pp=1), cp=4)
    engine = build_session(model, parallel, device, seed=SEED + 1, loss_fn=causal_lm_loss).engine
    load_checkpoint(saved, engine, torch.optim.SGD(engine.parameters(), lr=LR), model_name="llama")
    keys = transformers_names(model)
    return [(keys[n], p.detach().clone()) for n, p in engine.named_parameters()]


def _worker(spec: RankSpec, folders: dict[str, str], cases: list[str], out: str) -> None:
    device = join_job(spec)
    try:
        saved = Path(out) / "saved-cp2xpp2"
        records = {}
        for case in cases:
            if case in MOE_CASES or case in CAPACITY_CASES:
                records[case] = _train_moe(folders[{**MOE_CASES, **CAPACITY_CASES}[case][0]], case, device)
                continue
            layout, variant = VARIANTS.get(case, (case, ""))
            records[case] = _train(folders[CASES[layout][0]], layout, device, saved if case == RESUMED else None,
                                   variant)
        if RESUMED in cases:
            records["resumed"] = _resumed(folders["llama"], saved, device)
            records["saved_layout"] = read_meta(find_checkpoint(saved)).layout
        torch.save(records, Path(out) / f"rank{spec.rank}.pt")
    finally:
        close_session()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return spawned(tmp_path_factory.mktemp("cp"), list(CASES) + list(VARIANTS) + list(MOE_CASES) + list(CAPACITY_CASES))


def spawned(root: Path, cases: list[str]) -> tuple[list[dict], dict]:
    """The per-rank records of `cases` (one job of 4 ranks) and the references."""
    folders, references = {}, {}
    for family, config in tiny_configs().items():
        torch.manual_seed(SEED)
        model = transformers.AutoModelForCausalLM.from_config(config)
        folders[family] = str(root / family)
        model.save_pretrained(folders[family])
        initial = {n: p.detach().clone() for n, p in model.state_dict().items()}
        for dp in (1, 2):
            for documents in (False, True):
                model.load_state_dict(initial)
                references[family, dp, documents] = reference(model, dp, documents)
        model.load_state_dict(initial)
        references[family, 1, "boundary"] = reference(model, 1, "boundary")
        model.load_state_dict(initial)
        references[family, "bf16"] = reference(model, 1, False, "bf16")
    if "llama" in folders:
        references["llama", "lora"] = peft_reference(folders["llama"], 1)
    # the Llama with as many key/value heads as query heads (all-to-all at cp2 x tp2): one reference, dp 1
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64))
    folders["llama-mha"] = str(root / "llama-mha")
    model.save_pretrained(folders["llama-mha"])
    references["llama-mha", 1, False] = reference(model, 1, False)
    for family, dp in sorted({(MOE_CASES[case][0], MOE_CASES[case][3]) for case in cases if case in MOE_CASES}):
        folders[family] = str(root / family)
        model = moe_folder(root / family, family, seed=moe_parity.SEED)  # the same weights, written again
        references[family, "moe", dp] = moe_reference(model, dp)
    for family in {CAPACITY_CASES[case][0] for case in cases if case in CAPACITY_CASES} - set(folders):
        folders[family] = str(root / family)
        moe_folder(root / family, family, seed=moe_parity.SEED)
    spawn(_worker, ranks=range(4), world_size=4, master_addr="127.0.0.1", master_port=free_port(),
          args=(folders, cases, str(root)), timeout_s=900)
    return [torch.load(root / f"rank{r}.pt") for r in range(4)], references


@pytest.mark.parametrize("case", list(CASES))
def test_context_parallel_matches_unsplit(case, runs):
    per_rank, references = runs
    family, dp, *_, documents = CASES[case]
    ref = references[family, dp, documents]
    seen = compare_records([records[case] for records in per_rank], ref)
    assert seen == set(ref["params"]), f"parameters held by no rank: {sorted(set(ref['params']) - seen)}"
    if CASES[case][4] > 1:  # tp: the attention's projections are split over tp x (dp x cp) ranks, not dp x cp alone
        name = "transformer.h.0.attn.c_attn.weight" if family == "gpt2" else "model.layers.0.self_attn.q_proj.weight"
        assert {records[case]["held"][name] for records in per_rank} == {(ref["params"][name].numel() // 4,
                                                                        ref["params"][name].numel())}
    if CASES[case][2] == "hsdp":  # sharded within a shard group (a replica's 2 cp ranks), not over all 4 ranks
        name = "model.layers.0.self_attn.q_proj.weight"
        assert {records[case]["held"][name] for records in per_rank} == {(ref["params"][name].numel() // 2,
                                                                        ref["params"][name].numel())}


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_experts_split_beside_context_parallelism_match_unsplit_transformers(case, runs):
    """dp 2 x ep 2 x cp 2 (and cp 2 x pp 2 at ep 1): each cp rank routes its part of the sequences; the
    load-balancing loss (Qwen3-MoE) sums the router statistics over the cp pair, so the losses, every gradient and
    the final parameters equal transformers' unsplit model's per micro-batch (rtol 1e-5, atol 4e-5); DeepSeek-V3's
    bias moves by the tokens per expert summed over the dp x cp ranks as by the unsplit model's counts (atol 1e-6,
    the rate being 1e-3)."""
    per_rank, references = runs
    family, _, _, dp, ep, *_ = MOE_CASES[case]
    ref = references[family, "moe", dp]
    records = [records[case] for records in per_rank]
    seen = compare_records(records, ref)
    assert seen == set(ref["params"]), f"parameters held by no rank: {sorted(set(ref['params']) - seen)}"
    assert all(bool(record["split"]) == (ep > 1) for record in records)  # the experts were split over the ep pair
    assert set().union(*(record["imbalance"] for record in records)) == set(ref["imbalance"])  # a stage's layers
    for record in records:
        assert set(record["biases"]) == set(record["imbalance"])
        assert record["imbalance"] == pytest.approx({k: ref["imbalance"][k] for k in record["imbalance"]}, rel=1e-6)
        for index, bias in record["biases"].items():
            if ref["biases"][index] is None:
                assert bias is None
            else:
                torch.testing.assert_close(bias, ref["biases"][index], rtol=0, atol=1e-6)


def test_an_expert_capacity_beside_cp_drops_the_slots_of_whole_sequences(runs):
    """Capacity factor 0.5 at dp 2 x ep 2 x cp 2: the cp pair's choices are gathered and served in token order, so
    the same slots are dropped as on whole sequences (dp 2 x ep 2 x pp 2, the same micro-batches): the losses, every
    gradient and the final parameters agree (rtol 1e-5, atol 4e-5), and so does each layer's dropped count (summed
    over the dp x cp ranks), which is not zero."""
    per_rank, _ = runs
    cut, whole = ([records[case] for records in per_rank] for case in CAPACITY_CASES)
    ref = {"losses": whole[0]["losses"], "params": {n: v for record in whole for n, v in record["params"]},
           "grads": [{n: g for record in whole for n, g in record["grads"][step]} for step in range(2)]}
    assert compare_records(cut, ref) == set(ref["params"])
    dropped = {k: v for record in whole for k, v in record["dropped"].items()}  # a stage's layers
    assert all(record["dropped"] == dropped for record in cut) and all(lost > 0 for lost, _ in dropped.values())


def test_documents_reference_differs_from_one_sequence(runs):
    """The packed cases can fail: the reference with documents is not the reference of one long sequence."""
    _, references = runs
    assert abs(references["llama", 1, True]["losses"][0] - references["llama", 1, False]["losses"][0]) > 1e-3


def test_the_boundary_documents_leave_a_ring_step_wholly_masked():
    """The "boundary" case can catch an exchange left unwaited: at cp 2, rank 0's second step (rank 1's keys) has
    every block wholly masked in every row of every step's batch, rank 1's none."""
    index = torch.stack([zigzag_index(SEQ, 2, r) for r in range(2)])
    for inputs, _ in batches(1, "boundary"):
        positions = inputs[1]
        starts = torch.stack([index[r][None] - zigzag_split(positions, 2, r) for r in range(2)])
        masks = [ContextMask(None, rank, 2, "ring", index, starts) for rank in (0, 1)]
        assert all(masks[0].block_mask(1, a, b) is False for a in (0, 1) for b in (0, 1))
        assert any(masks[1].block_mask(0, a, b) is not False for a in (0, 1) for b in (0, 1))


def test_checkpoint_written_at_cp2_resumes_at_cp4(runs):
    """Layout-free checkpoints: parameters are not split by cp, so cp 2 x pp 2's checkpoint loads at cp 4."""
    per_rank, references = runs
    layout = per_rank[0]["saved_layout"]  # the record names cp: 1 data replica, each sequence cut over 2 ranks
    assert (layout["world_size"], layout["dp"], layout["pp"], layout["cp"]) == (4, 1, 2, 2), layout
    ref = references["llama", 1, False]["params"]
    for records in per_rank:
        loaded = dict(records["resumed"])
        assert set(loaded) == set(ref)
        for name, value in loaded.items():
            torch.testing.assert_close(value, ref[name], rtol=1e-5, atol=4e-5, msg=lambda m: f"{name}: {m}")


def test_lora_with_context_parallelism_matches_the_unsplit_peft_model(runs):
    """PEFT's adapters on the attention and MLP projections, ring cp2 x pp2: the loss, every adapter gradient of
    every step and every final adapter equal `peft.get_peft_model`'s on the unsplit model (rtol 1e-5, atol 4e-5);
    only adapters train."""
    per_rank, references = runs
    ref = references["llama", "lora"]
    records = [records["llama-ring-cp2xpp2-lora"] for records in per_rank]
    seen = compare_records(records, ref)
    assert seen == set(ref["params"]), f"adapters held by no rank: {sorted(set(ref['params']) - seen)}"
    assert all(".lora_A." in name or ".lora_B." in name for name in seen)


@pytest.mark.parametrize("case", [case for case, (_, variant) in VARIANTS.items() if variant.startswith("sp")])
def test_sequence_and_loss_parallelism_beside_cp_match_unsplit(case, runs):
    """Ring cp2 x tp2 (and all-to-all, for a Llama with 4 key/value heads) with --sequence-parallel (each rank's norms, residual adds and stage boundary on 1/4 of every
    sequence, gathered to its cp part before attention and MLP), and with --loss-parallel too (the logits of the cp
    part split over the vocabulary): the loss on every rank, every gradient of every step and every final parameter
    equal the unsplit transformers model's (rtol 1e-5, atol 4e-5), and so does the first batch's evaluated loss;
    q_proj split over the 4 ranks (tp x FSDP2)."""
    per_rank, references = runs
    ref = references[CASES[VARIANTS[case][0]][0], 1, False]
    seen = compare_records([records[case] for records in per_rank], ref)
    assert seen == set(ref["params"]), f"parameters held by no rank: {sorted(set(ref['params']) - seen)}"
    name = "model.layers.0.self_attn.q_proj.weight"
    assert {records[case]["held"][name] for records in per_rank} == {(ref["params"][name].numel() // 4,
                                                                    ref["params"][name].numel())}
    for records in per_rank:  # evaluation (no loss_parallel context: the logits of the cp part gathered)
        assert records[case]["evaluated"] == pytest.approx(ref["losses"][0], rel=1e-5, abs=4e-5)
    if case.endswith("-lp"):  # the head split over the vocabulary (tp) and sharded by FSDP2 over cp
        name = "lm_head.weight"
        assert {records[case]["held"][name] for records in per_rank} == {(ref["params"][name].numel() // 4,
                                                                        ref["params"][name].numel())}


def _relative(actual: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / scale.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("case", [case for case, (_, variant) in VARIANTS.items() if variant == "bf16"])
def test_bf16_with_context_parallelism_matches_the_unsplit_bf16_model(case, runs):
    """bf16 autocast at cp2 x pp2 against the unsplit model under bf16 autocast, tensor by tensor in the 2-norm,
    relative to the fp32 run's: two bf16 runs of one model agree within twice the bf16 budget of
    tests/tolerances.py (3 (u) sqrt(D), D = 14 rounding stages for the losses of this 2-layer model, 28 for the
    gradients; the final parameters within LR times the gradients' bounds). The ring's blocks run the fused kernel
    on the bf16 inputs (autocast off inside the ring, fp32 accumulation and merge), the all-to-all's transformers'
    sdpa as the reference's: both are within the budget of the reference, not equal to it. bf16 really ran: the step-0
    gradients are more than u/4 away from fp32's."""
    per_rank, references = runs
    exact, ref = references["llama", 1, False], references["llama", "bf16"]
    forward = forward_stages(2)
    bound = {"loss": 2 * budget(forward), "grad": 2 * budget(2 * forward)}
    for record in (records[case] for records in per_rank):
        for step, loss in enumerate(record["losses"]):
            error = _relative(torch.tensor(loss), torch.tensor(ref["losses"][step]), torch.tensor(exact["losses"][step]))
            assert error <= bound["loss"], f"step {step} loss: {error:.2e} > {bound['loss']:.2e}"
        away = max(_relative(grad, exact["grads"][0][name], exact["grads"][0][name]) for name, grad in record["grads"][0])
        assert away > U / 4, f"step-0 gradients within {away:.1e} of fp32's: bf16 autocast did not run"
        for step, grads in enumerate(record["grads"]):
            for name, grad in grads:
                error = _relative(grad, ref["grads"][step][name], exact["grads"][step][name])
                assert error <= bound["grad"], f"step {step} gradient of {name}: {error:.2e} > {bound['grad']:.2e}"
        for name, value in record["params"]:
            allowed = LR * bound["grad"] * sum(grads[name].double().norm().item() for grads in exact["grads"])
            error = (value.double() - ref["params"][name].double()).norm().item()
            assert error <= allowed + 1e-6, f"parameter {name}: {error:.2e} > {allowed:.2e}"

"""Mixture-of-experts parity: each MoE family's tiny folder (tests/moe_folders.py, experts stored one by one),
pipelined, equals transformers' unsplit model loaded from the same folder, with the load-balancing loss on.

One spawned job of 4 ranks runs every case: pp=2 layouts on two pairs of ranks (each pair its own family at the
same time) under 1F1B (all six families), interleaved 1F1B, ZBV, DualPipeV (two stages per rank), 1F1B and ZBV with
`--checkpoint always`, and dp=2 x pp=2 with FSDP2 over all four; and a checkpoint written at dp=2 x pp=2 after
step 1, resumed at pp=4 for step 2 (layout-free keys: the experts, the routers); and LoRA through PEFT on a frozen
MoE base: at pp=2 (1F1B) with adapters on attention, the routers (`gate.weight`) and the fused experts
(`experts.gate_up_proj`, `experts.down_proj`: PEFT's `target_parameters`, one adapter per expert), Qwen3-MoE on ranks
0-1 and Mixtral on 2-3, and with the same adapters at dp=2 x ep=2 x pp=2 and dp=4 x ep=2 x pp=1 (DDP, the experts
and their adapters split: each rank its experts' rows of A and columns of B, gathered for the comparison), against
`peft.get_peft_model` of transformers' model with the same adapters (every adapter gradient, the losses, the final
adapters; the base bitwise unchanged); the adapters of dp=2 x ep=2 x pp=2 saved, exported with `--peft` and loaded
by `PeftModel.from_pretrained` (the reference's adapters and logits), and loaded again at ep 2 and ep 1 bit for bit. Two SGD steps (a full batch, then a right-padded
one: micro-batches of unequal token counts). The reference is transformers' model run per micro-batch
(`output_router_logits=True`, `router_aux_loss_coef` 0.1): each micro-batch's `loss` (cross-entropy + coef x
aux_loss) weighted by its counted tokens over the global count (the definition of `pipetrain.moe.router`).
Losses, every gradient (experts, routers, shared experts included) at each step and every final parameter
agree within rtol 1e-5 / atol 4e-5.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import torch.distributed as dist  # noqa: E402

from pipetrain.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from pipetrain.config import ParallelConfig, PipelineConfig  # noqa: E402
from pipetrain.launch.env import free_port  # noqa: E402
from pipetrain.launch.spawn import RankSpec, spawn  # noqa: E402
from pipetrain.pipeline import PipelineEngine  # noqa: E402
from pipetrain.session import build_session, close_session, join_job  # noqa: E402
from pipetrain.workloads.hf.causal_lm import HFCausalLM  # noqa: E402
from tests.distributed.test_hf_parity import ATOL, RTOL, _full, compare_records  # noqa: E402
from tests.hf_folders import transformers_names  # noqa: E402
from tests.moe_folders import SEQ, VOCAB, moe_configs, moe_folder  # noqa: E402
from pipetrain.blocks import build_sequential  # noqa: E402
from pipetrain.lora import LoraBlocks, LoraSettings  # noqa: E402
from pipetrain.lora.export import export_peft  # noqa: E402
from pipetrain.parallel.experts import expert_layout, gather_experts, is_expert  # noqa: E402

SEED, LR, SIZE, CHUNKS = 0, 0.1, 8, 4  # samples per replica, micro-batches per replica
#: pp=2 rounds: (schedule, stages per rank, recomputation) -> (family on ranks 0-1, family on ranks 2-3)
PAIR_ROUNDS = {
    ("1f1b", 1, "never"): [("qwen3_moe", "mixtral"), ("qwen2_moe", "olmoe"), ("deepseek_v3", "gpt_oss")],
    ("interleaved-1f1b", 2, "never"): [("qwen3_moe", "deepseek_v3")],
    ("zbv", 2, "never"): [("mixtral", "qwen2_moe")],
    ("dualpipev", 2, "never"): [("qwen3_moe", "gpt_oss")],
    ("1f1b", 1, "always"): [("qwen3_moe", "deepseek_v3")],
    ("zbv", 2, "always"): [("olmoe", "qwen3_moe")],  # recomputed in a split backward (once per half)
}
#: dp=2 x pp=2 with FSDP2, all four ranks
DP_CASES = ["qwen3_moe"]
#: saved after step 1 at dp=2 x pp=2 (DDP), resumed for step 2 at pp=4 (8 micro-batches: the same micro-batches)
RESUMED = "qwen3_moe"
#: LoRA on a frozen MoE base: pp=2 on the two pairs (the experts adapted: ep 1), dp=2 x ep=2 x pp=2 (experts split)
LORA_PAIR, LORA_EP = ("qwen3_moe", "mixtral"), "qwen3_moe"
ATTENTION_AND_ROUTER = ("q_proj", "v_proj", "gate.weight")
EXPERTS = ("experts.gate_up_proj", "experts.down_proj")
#: the ep layouts (dp, pp; ep 2) of the LoRA cases: the experts and their adapters split, the expert-data-parallel
#: group of one rank (dp 2 x pp 2) and of two (dp 4 x pp 1: each expert adapter's gradient summed over 2 replicas)
LORA_EP_LAYOUTS = {"dp2xep2xpp2": (2, 2), "dp4xep2xpp1": (4, 1)}
LORA = {"pp2": LoraSettings(rank=2, init=False, targets=ATTENTION_AND_ROUTER + EXPERTS),
        **{layout: LoraSettings(rank=2, init=False, targets=ATTENTION_AND_ROUTER + EXPERTS)
           for layout in LORA_EP_LAYOUTS}}
PEFT_PREFIX = "base_model.model."


def case_name(layout: tuple, family: str) -> str:
    schedule, stages, recompute = layout
    return f"{family}-pp2-{schedule}-x{stages}" + ("-checkpoint" if recompute != "never" else "")


def make_batches(dp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input ids, labels) of each step for `dp` replicas: a full batch, then a right-padded one."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for step in range(2):
        ids = torch.randint(1, VOCAB, (SIZE * dp, SEQ), generator=gen)
        labels = ids.clone()
        if step == 1:
            labels[torch.arange(SEQ)[None] >= torch.randint(4, SEQ + 1, (SIZE * dp, 1), generator=gen)] = -100
        out.append((ids, labels))
    return out


def reference(model: torch.nn.Module, dp: int) -> dict:
    """transformers' model per micro-batch (the pipeline's split: `CHUNKS` per replica), each micro-batch's loss
    weighted by its counted tokens over the global count; of a PEFT model, its adapters (PEFT's prefix dropped)."""
    trainable = {n.removeprefix(PEFT_PREFIX): p for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.SGD(trainable.values(), lr=LR)
    losses, grads = [], []
    for x, labels in make_batches(dp):
        opt.zero_grad()
        size = SIZE // CHUNKS
        total_count = (labels[:, 1:] != -100).sum()
        step_loss = 0.0
        for part in range(0, x.shape[0], size):
            ids, lab = x[part:part + size], labels[part:part + size]
            weight = (lab[:, 1:] != -100).sum() / total_count
            loss = model(input_ids=ids, labels=lab, output_router_logits=True).loss * weight
            loss.backward()
            step_loss += loss.item()
        losses.append(step_loss)
        grads.append({n: p.grad.clone() for n, p in trainable.items()})
        opt.step()
    return {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in trainable.items()}}


def lora_reference(folder: str, settings: LoraSettings, dp: int) -> dict:
    """`reference` of transformers' model of `folder` with PEFT's adapters of `settings`, started from the adapters
    pipetrain's block seeds give (PEFT's layers with `init_lora_weights=False`: B not zero)."""
    model = LoraBlocks(HFCausalLM.from_folder(folder, seq_len=SEQ), settings)
    keys = transformers_names(model)
    initial = {PEFT_PREFIX + keys[n]: p.detach().clone()
               for n, p in build_sequential(model, seed=SEED).named_parameters() if p.requires_grad}
    base = transformers.AutoModelForCausalLM.from_pretrained(folder)
    peft_model = pytest.importorskip("peft").get_peft_model(base, settings.peft_config(settings.targets))
    trainable = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}
    assert set(trainable) == set(initial), sorted(set(trainable) ^ set(initial))[:4]
    with torch.no_grad():
        for name, param in trainable.items():
            param.copy_(initial[name])
    out = reference(peft_model, dp)
    with torch.no_grad():
        out["logits"] = peft_model.eval()(input_ids=make_batches(1)[0][0]).logits
    return out


def _whole(engine, param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` (the parameter's tensor or gradient) whole: a DTensor's full tensor, an expert slice (the experts'
    own weights, or their LoRA adapters) gathered over the engine's expert-parallel group."""
    value = _full(value)
    group = getattr(engine, "expert_group", None)
    if group is not None and is_expert(param):
        dim, parts = expert_layout(param)
        value = gather_experts(value, group, dim=dim, parts=parts)
    return value.clone()


def _steps(engine, model: HFCausalLM | LoraBlocks, dp: int, replica: int, save: Path | None = None,
           gather: bool = False) -> dict:
    """Two SGD steps of `engine`: its losses, the gradients and final values of what it trains (with `gather`, expert
    slices whole: `_whole`; else each rank's own), and how far its frozen parameters moved (0 unless a LoRA base
    changed); then a checkpoint to `save`, when given."""
    keys = transformers_names(model)

    def held(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return _whole(engine, param, value) if gather else _full(value).clone()

    trained = [(n, p) for n, p in engine.named_parameters() if p.requires_grad]
    frozen = {n: _full(p.detach()).clone() for n, p in engine.named_parameters() if not p.requires_grad}
    opt = torch.optim.SGD([p for _, p in trained], lr=LR)
    losses, grads = [], []
    for x, labels in make_batches(dp):
        share = slice(replica * SIZE, (replica + 1) * SIZE)
        opt.zero_grad()
        losses.append(engine.step(x[share], labels[share]).loss)
        grads.append([(keys[n], held(p, p.grad)) for n, p in trained])
        opt.step()
    if save is not None:
        save_checkpoint(save, engine, opt, step=2)
    named = dict(engine.named_parameters())
    return {"losses": losses, "grads": grads, "params": [(keys[n], held(p, p.detach())) for n, p in trained],
            "base_moved": max([(_full(named[n].detach()) - v).abs().max().item() for n, v in frozen.items()] + [0.0])}


def _reloaded(folder: str, parallel: ParallelConfig, device: torch.device, checkpoint: Path) -> list:
    """The adapters (whole) of a fresh `parallel` session of `folder` after loading `checkpoint`."""
    model = LoraBlocks(HFCausalLM.from_folder(folder, seq_len=SEQ), LORA["dp2xep2xpp2"])
    engine = build_session(model, parallel, device, seed=SEED + 1, loss_fn=model.loss()).engine
    load_checkpoint(checkpoint, engine)
    keys = transformers_names(model)
    return [(keys[n], _whole(engine, p, p.detach())) for n, p in engine.named_parameters() if p.requires_grad]


def _lora_cases(folders: dict[str, str], device: torch.device, pair, out: Path) -> dict:
    """The LoRA cases of this rank: pp=2 on its pair (its family of `LORA_PAIR`), then the ep layouts (the adapters
    of dp=2 x ep=2 x pp=2 saved, and loaded again at that layout and at dp=2 x pp=2, ep 1)."""
    family = LORA_PAIR[dist.get_rank() // 2]
    model = LoraBlocks(HFCausalLM.from_folder(folders[family], seq_len=SEQ), LORA["pp2"])
    engine = PipelineEngine(model, PipelineConfig(pp=2, n_microbatches=CHUNKS), device=device, pp_group=pair,
                            loss_fn=model.loss(), seed=SEED, metrics_group=pair)
    records = {f"{family}-lora-pp2": _steps(engine, model, 1, 0)}
    for layout, (dp, pp) in LORA_EP_LAYOUTS.items():
        model = LoraBlocks(HFCausalLM.from_folder(folders[LORA_EP], seq_len=SEQ), LORA[layout])
        pipeline = PipelineConfig(pp=pp, schedule="1f1b" if pp > 1 else "gpipe", n_microbatches=CHUNKS)
        session = build_session(model, ParallelConfig(dp=dp, ep=2, pipeline=pipeline), device, seed=SEED,
                                loss_fn=model.loss())
        save = out / "lora-ep2" if layout == "dp2xep2xpp2" else None
        records[f"{LORA_EP}-lora-{layout}"] = _steps(session.engine, model, dp, session.mesh.dp_rank, save,
                                                     gather=True)
    for name, ep in (("ep2", 2), ("ep1", 1)):
        parallel = ParallelConfig(dp=2, ep=ep, pipeline=PipelineConfig(pp=2, n_microbatches=CHUNKS))
        records[f"{LORA_EP}-lora-reloaded-{name}"] = _reloaded(folders[LORA_EP], parallel, device, out / "lora-ep2")
    return records


def _resumed(folder: str, device: torch.device, out: Path) -> dict:
    """Step 1 at dp=2 x pp=2, a checkpoint, step 2 at pp=4 from it: step 2's loss, gradients, final parameters."""
    model = HFCausalLM.from_folder(folder, seq_len=SEQ)
    keys = transformers_names(model)
    (x1, labels1), (x2, labels2) = make_batches(2)
    pipeline = PipelineConfig(pp=2, schedule="1f1b", n_microbatches=CHUNKS)
    session = build_session(model, ParallelConfig(dp=2, dp_mode="ddp", pipeline=pipeline), device, seed=SEED,
                            loss_fn=model.loss())
    opt = torch.optim.SGD(session.engine.parameters(), lr=LR)
    share = slice(session.mesh.dp_rank * SIZE, (session.mesh.dp_rank + 1) * SIZE)
    session.engine.step(x1[share], labels1[share])
    opt.step()
    save_checkpoint(out / "resume", session.engine, opt, step=1)
    pipeline = PipelineConfig(pp=4, schedule="1f1b", n_microbatches=2 * CHUNKS)
    engine = build_session(model, ParallelConfig(pipeline=pipeline), device, seed=SEED + 1,
                           loss_fn=model.loss()).engine
    opt = torch.optim.SGD(engine.parameters(), lr=LR)
    load_checkpoint(out / "resume", engine, opt)
    loss = engine.step(x2, labels2).loss
    grads = [(keys[n], p.grad.clone()) for n, p in engine.named_parameters()]
    opt.step()
    return {"losses": [loss], "grads": [grads], "params": [(keys[n], p.detach().clone())
                                                          for n, p in engine.named_parameters()]}


def _worker(spec: RankSpec, folders: dict[str, str], out: str) -> None:
    device = join_job(spec)
    try:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        pair = pairs[dist.get_rank() // 2]
        records = {}
        for layout, rounds in PAIR_ROUNDS.items():
            schedule, stages, recompute = layout
            for families in rounds:
                family = families[dist.get_rank() // 2]
                model = HFCausalLM.from_folder(folders[family], seq_len=SEQ)
                config = PipelineConfig(pp=2, schedule=schedule, n_microbatches=CHUNKS, stages_per_rank=stages,
                                        checkpoint=recompute)
                engine = PipelineEngine(model, config, device=device, pp_group=pair, loss_fn=model.loss(),
                                        seed=SEED, metrics_group=pair)
                records[case_name(layout, family)] = _steps(engine, model, 1, 0)
        for family in DP_CASES:
            model = HFCausalLM.from_folder(folders[family], seq_len=SEQ)
            pipeline = PipelineConfig(pp=2, schedule="1f1b", n_microbatches=CHUNKS)
            session = build_session(model, ParallelConfig(dp=2, dp_mode="fsdp", pipeline=pipeline), device,
                                    seed=SEED, loss_fn=model.loss())
            records[f"{family}-dp2xpp2-fsdp"] = _steps(session.engine, model, 2, session.mesh.dp_rank)
        records[f"{RESUMED}-resumed-pp4"] = _resumed(folders[RESUMED], device, Path(out))
        records.update(_lora_cases(folders, device, pair, Path(out)))
        torch.save(records, Path(out) / f"rank{spec.rank}.pt")
    finally:
        close_session()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    folders, references = {}, {}
    for name in moe_configs():
        folders[name] = str(root / name)
        moe_folder(root / name, name, seed=SEED)
        for dp in (1, 2) if name in DP_CASES else (1,):
            references[name, dp] = reference(transformers.AutoModelForCausalLM.from_pretrained(folders[name]), dp)
    for name in LORA_PAIR:
        references[name, "lora-pp2"] = lora_reference(folders[name], LORA["pp2"], 1)
    for layout, (dp, _) in LORA_EP_LAYOUTS.items():
        references[LORA_EP, f"lora-{layout}"] = lora_reference(folders[LORA_EP], LORA[layout], dp)
    spawn(_worker, ranks=range(4), world_size=4, master_addr="127.0.0.1", master_port=free_port(),
          args=(folders, str(root)), timeout_s=900)
    return [torch.load(root / f"rank{r}.pt") for r in range(4)], references, folders, root


def _check(per_rank: list[dict], case: str, ref: dict, ranks: range) -> None:
    seen = compare_records([per_rank[r][case] for r in ranks if case in per_rank[r]], ref)
    assert seen == set(ref["params"]), f"{case}: parameters held by no rank: {sorted(set(ref['params']) - seen)}"


@pytest.mark.parametrize(("layout", "family", "pair"), [
    (layout, family, index) for layout, rounds in PAIR_ROUNDS.items() for families in rounds
    for index, family in enumerate(families)])
def test_pipelined_moe_family_matches_unsplit_transformers(layout, family, pair, runs):
    per_rank, references, _, _ = runs
    _check(per_rank, case_name(layout, family), references[family, 1], range(2 * pair, 2 * pair + 2))


def test_a_checkpoint_of_dp2_pp2_resumes_at_pp4(runs):
    per_rank, references, _, _ = runs
    ref = references[RESUMED, 2]
    _check(per_rank, f"{RESUMED}-resumed-pp4", {**ref, "losses": ref["losses"][1:], "grads": ref["grads"][1:]},
           range(4))


@pytest.mark.parametrize("family", DP_CASES)
def test_data_parallel_fsdp_pipelined_moe_matches_unsplit_transformers(family, runs):
    per_rank, references, _, _ = runs
    _check(per_rank, f"{family}-dp2xpp2-fsdp", references[family, 2], range(4))


@pytest.mark.parametrize(("family", "layout", "ranks"), [(LORA_PAIR[0], "pp2", range(2)), (LORA_PAIR[1], "pp2", range(2, 4)),
                                                         *((LORA_EP, layout, range(4)) for layout in LORA_EP_LAYOUTS)])
def test_lora_on_a_moe_base_equals_the_unsplit_peft_model(family, layout, ranks, runs):
    per_rank, references, _, _ = runs
    case = f"{family}-lora-{layout}"
    _check(per_rank, case, references[family, f"lora-{layout}"], ranks)
    for rank in ranks:
        assert per_rank[rank][case]["base_moved"] == 0.0, f"rank {rank}: a frozen base weight changed"
    adapted = {name for name, _ in per_rank[ranks[0]][case]["params"]}
    assert any(".mlp.gate.lora_A." in n for n in adapted), "no router adapter on the first stage"
    # the experts' adapters: one per expert, PEFT's (r x E, in) layout (under ep 2 each rank's half, gathered here)
    assert any(".mlp.experts.lora_B." in n for n in adapted) and any(".base_layer.lora_A." in n for n in adapted)


def test_lora_adapters_of_split_experts_saved_at_ep2_load_in_peft_at_ep1(runs, tmp_path):
    """The checkpoint of dp=2 x ep=2 x pp=2's adapters (each rank's experts' rows of A, columns of B) exported as a
    PEFT folder: `PeftModel.from_pretrained` of transformers' model loads it (the whole adapters) and gives the
    reference's logits after its two steps, rtol 1e-5 / atol 4e-5; the same checkpoint loads again at ep 2 and at
    ep 1 (dp=2 x pp=2) bit for bit."""
    peft = pytest.importorskip("peft")
    per_rank, references, folders, root = runs
    ref = references[LORA_EP, "lora-dp2xep2xpp2"]
    model = LoraBlocks(HFCausalLM.from_folder(folders[LORA_EP], seq_len=SEQ), LORA["dp2xep2xpp2"])
    out = export_peft(root / "lora-ep2", model, tmp_path / "adapter")
    loaded = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(folders[LORA_EP]),
                                            out).eval()
    adapters = {n.removeprefix(PEFT_PREFIX): p for n, p in loaded.named_parameters() if ".lora_" in n}
    assert set(adapters) == set(ref["params"]) and any(".mlp.experts.lora_B." in n for n in adapters)
    for name, value in adapters.items():
        torch.testing.assert_close(value, ref["params"][name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
    with torch.no_grad():
        logits = loaded(input_ids=make_batches(1)[0][0]).logits
    torch.testing.assert_close(logits, ref["logits"], rtol=RTOL, atol=ATOL)
    saved = {n: v for records in per_rank for n, v in records[f"{LORA_EP}-lora-dp2xep2xpp2"]["params"]}
    for layout in ("ep2", "ep1"):
        reloaded = {n: v for records in per_rank for n, v in records[f"{LORA_EP}-lora-reloaded-{layout}"]}
        assert set(reloaded) == set(saved), layout
        for name, value in reloaded.items():
            assert torch.equal(value, saved[name]), f"{layout}: {name}"

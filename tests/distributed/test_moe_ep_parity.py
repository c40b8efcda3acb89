"""Expert parallelism under the pipeline: ep=2 x pp=2 on 4 gloo ranks equals the unsplit model (one spawned job).

The model is a minimal MoE `BlockModel` built here from transformers' own Qwen3-MoE decoder layer (pipetrain's HF
blocks around `Qwen3MoeDecoderLayer`: 4 experts, top-2, hidden 32, 4 layers): an embedding, 4 MoE layers, a head.
Its experts are transformers' fused `Qwen3MoeExperts` (its "batched_mm" implementation) in the reference (the unsplit `BlockSequential`, one process,
the whole batch, mean token loss, SGD) and `ExpertParallelExperts` on the ranks: dp=2 (one expert-parallel group of
the two dp ranks of each stage: experts 0-1 on dp rank 0, 2-3 on dp rank 1) x pp=2. Layouts: 1F1B with DDP,
interleaved 1F1B (4 stages) with DDP, 1F1B with `--checkpoint always` (the recomputed forward dispatches again),
GPipe with FSDP2 (experts sharded over their own expert-data-parallel mesh, here of one rank), ZBV and DualPipeV with
FSDP2 (4 micro-batches), DualPipeV with `moe_overlap` (its fused forward-and-backward actions run at once, in two
threads; the experts' backward exchanges on a second group), also with `--checkpoint always`; and dp=4 x pp=1
at ep=2 (two expert-parallel groups: each expert's gradient summed over the two ranks holding it), also under HSDP
(`--dp-shard` 2: each slice replicated over 2 ranks; 4: sharded over 2). Over three SGD steps
(the last batch shorter): the losses, every gradient (experts, routers, attention, embedding, head) and the final
parameters equal the reference's within rtol 1e-5 / atol 4e-5, a forward-only evaluation gives its loss, and the
global gradient norm (`Session.grad_norm`, what clipping uses) equals the unsplit model's (each expert slice once). A
second family of checks: the same job at ep=1 (dp=2 DDP) has the experts replicated (each rank all 4); under bf16
autocast, ep=2 equals ep=1 within bf16 round-off (dp=2 x pp=2, 1F1B). Checkpoints
move between ep=2 and ep=1 (model and AdamW state; `test_checkpoints_move_between_ep2_and_ep1`).

The same job then trains the MoE families' tiny folders (tests/moe_folders.py: Qwen3-MoE with 8 experts and a dense
first layer, Mixtral with 4; the load-balancing loss on) at dp=2 x ep=2 x pp=2 under 1F1B and interleaved 1F1B
(DDP), and at dp=2 x ep=2 x tp=2 with FSDP2 (pp=1: the attention split over each TP pair, the MoE block whole on
both, the experts split over the EP pair of each TP rank); Qwen2-MoE (its gated shared expert), OLMoE and DeepSeek-V3
(latent attention, group-limited routing, its balancing bias) at dp=2 x ep=2 x pp=2 under 1F1B; Qwen3-MoE at dp=4
under HSDP (shard groups of 2) x ep=2, pp=1 (the experts' FSDP2 over their (2, 1) replicate x shard mesh); each against
transformers' unsplit model from the same folder,
run per micro-batch as test_moe_parity's
reference: losses, every gradient (each rank's expert slices against the same rows of transformers' fused
tensors) and the final parameters, rtol 1e-5 / atol 4e-5. Generation (`pipetrain generate --ep`, and `eval`'s answers)
on the Qwen3-MoE folder: two replicas of a pp=2 pipeline, each its own prompts and number of new tokens, give the
same greedy tokens with the experts whole on each rank (ep=1) and split over the two replicas (ep=2: the replica that
ends first steps on with the other, `Route.lockstep`); at ep=2 x tp=2 (pp=1, `generate.job.place_rank`) each
replica's greedy tokens equal transformers' `generate` on the unsplit folder. Checkpoints of dp=4 x ep=2 also move
between FSDP2 and HSDP (2 x 2).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import torch.nn.functional as F  # noqa: E402

from pipetrain.blocks import build_sequential  # noqa: E402
from pipetrain.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from pipetrain.compat import overlap  # noqa: E402
from pipetrain.config import ParallelConfig, PipelineConfig  # noqa: E402
from pipetrain.errors import ConfigError  # noqa: E402
from pipetrain.launch.env import free_port  # noqa: E402
from pipetrain.launch.spawn import RankSpec, spawn  # noqa: E402
from pipetrain.moe.experts import ExpertParallelExperts  # noqa: E402
from pipetrain.moe.split import check_expert_parallel  # noqa: E402
from pipetrain.parallel.experts import gather_experts, is_expert  # noqa: E402
from pipetrain.pipeline import TokenCrossEntropy  # noqa: E402
from pipetrain.session import build_session, close_session, join_job  # noqa: E402
from pipetrain.workloads.hf.blocks import DecoderLayer, Embedding, Head  # noqa: E402
from pipetrain.workloads.hf.causal_lm import HFCausalLM  # noqa: E402
from pipetrain.workloads.hf.families import family_of  # noqa: E402
from tests.distributed import test_moe_parity as moe_parity  # noqa: E402
from tests.hf_folders import transformers_names  # noqa: E402
from tests.moe_folders import SEQ as FOLDER_SEQ, moe_folder  # noqa: E402

RTOL, ATOL = 1e-5, 4e-5
#: bf16 ep 2 against bf16 ep 1: the same arithmetic up to the batch shapes of the experts' matmuls
BF16_RTOL, BF16_ATOL = 1e-3, 1e-3
SEED, LR, VOCAB, SEQ, EXPERTS = 3, 0.05, 64, 6, 4
BATCHES = [8, 8, 4]


def moe_config(**overrides):
    config = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         num_experts=EXPERTS, num_experts_per_tok=2, norm_topk_prob=True,
                                         max_position_embeddings=64, **overrides)
    config._attn_implementation = "sdpa"
    # transformers' batched experts: its eager loop cannot run on the meta device (`nonzero`), where the engine
    # infers the shapes between stages; its grouped one asks bf16 there
    config._experts_implementation = "batched_mm"
    return config


class TinyMoE:
    """Embedding | 4 Qwen3-MoE decoder layers | norm + head, initialised per block from the block's seed."""

    def __init__(self, **overrides) -> None:
        self.config = moe_config(**overrides)
        self.family = family_of(self.config)
        self.num_blocks = self.config.num_hidden_layers + 2

    def build_block(self, index: int) -> torch.nn.Module:
        if index == 0:
            block = Embedding(self.config, self.family)
        elif index == self.num_blocks - 1:
            block = Head(self.config, self.family)
        else:
            block = DecoderLayer(self.config, self.family, index - 1)
        with torch.no_grad():
            for name, param in block.named_parameters():
                if param.dim() == 1:
                    param.fill_(1.0)  # norms
                else:  # routers wide apart (no near-ties in the top-k), the rest small
                    param.normal_(0.0, 1.0 if name.endswith("gate.weight") else 0.1)
        return block

    def example_input(self, batch_size: int) -> torch.Tensor:
        return torch.zeros(batch_size, SEQ, dtype=torch.long)


def make_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(11)
    return [(torch.randint(0, VOCAB, (n, SEQ), generator=gen), torch.randint(0, VOCAB, (n, SEQ), generator=gen))
            for n in BATCHES]


def eval_batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return torch.randint(0, VOCAB, (4, SEQ), generator=gen), torch.randint(0, VOCAB, (4, SEQ), generator=gen)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def reference() -> dict:
    model = build_sequential(TinyMoE(), seed=SEED)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads, norms = [], [], []
    for x, y in make_batches():
        opt.zero_grad()
        loss = _loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
        opt.step()
    with torch.no_grad():
        x, y = eval_batch()
        evaluation = _loss(model(x), y).item()
    return {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "eval": evaluation, "norms": norms}


def layouts() -> dict[str, ParallelConfig]:
    def layout(schedule: str, *, ep: int = 2, mode: str = "ddp", checkpoint: str = "never", chunks: int = 2,
               overlap: bool = False) -> ParallelConfig:
        return ParallelConfig(dp=2, dp_mode=mode, ep=ep, pipeline=PipelineConfig(
            pp=2, schedule=schedule, n_microbatches=chunks, checkpoint=checkpoint, moe_overlap=overlap))
    return {
        "ep2-pp2-1f1b": layout("1f1b"),
        "ep2-pp2-interleaved": layout("interleaved-1f1b"),
        "ep2-pp2-1f1b-recompute": layout("1f1b", checkpoint="always"),
        "ep2-pp2-gpipe-fsdp": layout("gpipe", mode="fsdp"),
        "ep2-pp2-zbv-fsdp": layout("zbv", mode="fsdp"),  # the backward split in input and weight parts
        # DualPipeV (DDP is refused there): run in turn, then its fused actions overlapped (also recomputing)
        "ep2-pp2-dualpipev-fsdp": layout("dualpipev", mode="fsdp", chunks=4),
        "ep2-pp2-dualpipev-fsdp-overlap": layout("dualpipev", mode="fsdp", chunks=4, overlap=True),
        "ep2-pp2-dualpipev-fsdp-overlap-recompute": layout("dualpipev", mode="fsdp", chunks=4, overlap=True,
                                                           checkpoint="always"),
        "ep1-dp2-pp2-1f1b": layout("1f1b", ep=1),
        # two expert-parallel groups: each expert's gradient also summed over its expert-data-parallel pair
        "ep2-dp4-pp1": ParallelConfig(dp=4, ep=2, pipeline=PipelineConfig(pp=1, schedule="gpipe", n_microbatches=1)),
        # HSDP: shard groups of 2 (each expert slice replicated over 2 ranks) and one group of 4 (sharded over 2)
        **{f"ep2-dp4-pp1-hsdp{k}": ParallelConfig(dp=4, ep=2, dp_mode="hsdp", dp_shard=k, pipeline=PipelineConfig(
            pp=1, schedule="gpipe", n_microbatches=1)) for k in (2, 4)},
    }


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@contextmanager
def _counting_overlaps(counted: list[int]):
    """Counts, in `counted[0]`, the fused actions `compat.overlap` runs in two threads."""
    real = overlap._concurrently

    def counting(first, second):
        counted[0] += 1
        return real(first, second)

    overlap._concurrently = counting
    try:
        yield
    finally:
        overlap._concurrently = real


def _train(parallel: ParallelConfig, device: torch.device, precision: str = "fp32") -> dict:
    counted = [0]
    with _counting_overlaps(counted):
        record = _train_steps(parallel, device, precision)
    record["overlapped"] = counted[0]
    return record


def _train_steps(parallel: ParallelConfig, device: torch.device, precision: str = "fp32") -> dict:
    session = build_session(TinyMoE(), parallel, device, seed=SEED, loss_fn=TokenCrossEntropy(), precision=precision)
    engine, mesh = session.engine, session.mesh
    firsts = {}
    for module in engine.modules:
        for name, sub in module.named_modules():
            if isinstance(sub, ExpertParallelExperts):  # every parameter: GPT-OSS's biases too
                firsts.update({id(p): (sub.first_expert, sub.local_experts) for p in sub.parameters(recurse=False)})
    slices = {name: firsts.get(id(p)) for name, p in engine.named_parameters()}
    opt = torch.optim.SGD(engine.parameters(), lr=LR)
    losses, grads, norms = [], [], []
    for x, y in make_batches():
        share = y.shape[0] // parallel.dp  # dp ranks of one expert-parallel group get different tokens
        part = slice(mesh.dp_rank * share, (mesh.dp_rank + 1) * share)
        opt.zero_grad()
        losses.append(engine.step(x[part], y[part]).loss)
        norms.append(session.grad_norm())
        grads.append({name: _full(p.grad).clone() for name, p in engine.named_parameters()})
        opt.step()
    params = {name: _full(p.detach()).clone() for name, p in engine.named_parameters()}
    evaluation = engine.evaluate(*eval_batch()).loss
    return {"losses": losses, "grads": grads, "params": params, "slices": slices, "eval": evaluation, "norms": norms}


#: the MoE folders trained at dp=2 x ep=2 x pp=2 under these schedules (stages per rank), and at dp=2 x ep=2 x tp=2
#: (FSDP2, pp=1: the attention split over the TP pair, the experts over the EP pair of each TP rank)
FOLDER_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss")
FOLDER_SCHEDULES = {"1f1b": 1, "interleaved-1f1b": 2, "tp2-fsdp": None}
#: families without a tensor-parallel plan (GPT-OSS: per-head sinks, docs/moe.md): no tp2 case
FOLDER_NO_TP = ("gpt_oss",)
#: the other families with fused gated experts, at dp=2 x ep=2 x pp=2 under 1F1B only (DeepSeek-V3: no TP plan)
MORE_FAMILIES = ("qwen2_moe", "olmoe", "deepseek_v3")
#: HSDP: dp 4 (shard groups of 2, replicated twice) x ep 2, pp 1: each expert slice's FSDP2 over its own (2, 1) mesh
HSDP_CASE = ("qwen3_moe", "hsdp-dp4")
FOLDER_CASES = [(family, schedule) for family in FOLDER_FAMILIES for schedule in FOLDER_SCHEDULES
                if not (schedule == "tp2-fsdp" and family in FOLDER_NO_TP)] + \
    [(family, "1f1b") for family in MORE_FAMILIES] + [HSDP_CASE]


def _expert_slices(engine) -> dict[int, tuple[int, int]]:
    """id(expert parameter) -> (first expert, local experts) of every `ExpertParallelExperts` of the engine."""
    firsts = {}
    for module in engine.modules:
        for sub in module.modules():
            if isinstance(sub, ExpertParallelExperts):  # every parameter: GPT-OSS's biases too
                firsts.update({id(p): (sub.first_expert, sub.local_experts) for p in sub.parameters(recurse=False)})
    return firsts


def _train_folder(folder: str, schedule: str, device: torch.device) -> dict:
    model = HFCausalLM.from_folder(folder, seq_len=FOLDER_SEQ)
    if schedule == "tp2-fsdp":
        parallel = ParallelConfig(dp=2, ep=2, tp=2, dp_mode="fsdp", pipeline=PipelineConfig(
            pp=1, schedule="gpipe", n_microbatches=moe_parity.CHUNKS))
    elif schedule == "hsdp-dp4":
        parallel = ParallelConfig(dp=4, ep=2, dp_mode="hsdp", dp_shard=2, pipeline=PipelineConfig(
            pp=1, schedule="gpipe", n_microbatches=moe_parity.CHUNKS))
    else:
        parallel = ParallelConfig(dp=2, ep=2, pipeline=PipelineConfig(
            pp=2, schedule=schedule, n_microbatches=moe_parity.CHUNKS, stages_per_rank=FOLDER_SCHEDULES[schedule]))
    session = build_session(model, parallel, device, seed=moe_parity.SEED, loss_fn=model.loss())
    keys, firsts = transformers_names(model), _expert_slices(session.engine)
    record = moe_parity._steps(session.engine, model, parallel.dp, session.mesh.dp_rank)
    record["slices"] = {keys[n]: firsts.get(id(p)) for n, p in session.engine.named_parameters()}
    record["tp_split"] = {keys[n] for n, p in session.engine.named_parameters()  # sharded over dp and split over tp
                          if hasattr(p, "to_local") and p.to_local().numel() * 4 == p.numel()}
    return record


def _whole_params(engine) -> dict[str, torch.Tensor]:
    """Every parameter of the engine, FSDP2 shards gathered, expert slices gathered over the expert-parallel group."""
    from torch.distributed.tensor import DTensor

    group, out = engine.expert_group, {}
    for name, p in engine.named_parameters():
        value = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()
        out[name] = (gather_experts(value, group) if group is not None and is_expert(p) else value).clone()
    return out


def _adamw_step(ep: int, device: torch.device, batch: int, load: Path | None = None, save: Path | None = None,
                dp: int = 2, mode: str = "ddp"):
    """A dp x pp=4/dp 1F1B session at `ep` with AdamW (`mode`: DDP, FSDP2 or HSDP with shard groups of 2): (after
    `load`), one step on batch `batch`, (then `save`); returns the parameters after the load and after the step."""
    pp = 4 // dp
    parallel = ParallelConfig(dp=dp, ep=ep, dp_mode=mode, dp_shard=2 if mode == "hsdp" else None,
                              pipeline=PipelineConfig(pp=pp, schedule="1f1b" if pp > 1 else "gpipe", n_microbatches=2))
    session = build_session(TinyMoE(), parallel, device, seed=SEED, loss_fn=TokenCrossEntropy())
    engine = session.engine
    opt = torch.optim.AdamW(engine.parameters(), lr=0.01)
    if load is not None:
        load_checkpoint(load, engine, opt)
    loaded = _whole_params(engine)
    x, y = make_batches()[batch]
    share = y.shape[0] // dp
    part = slice(session.mesh.dp_rank * share, (session.mesh.dp_rank + 1) * share)
    opt.zero_grad()
    engine.step(x[part], y[part])
    opt.step()
    if save is not None:
        save_checkpoint(save, engine, opt, step=batch + 1)
    return loaded, _whole_params(engine)


def _checkpoint_round_trips(device: torch.device, out: Path) -> dict:
    """ep2 -> ep1 and ep1 -> ep2: a step, a checkpoint (model and AdamW state), then the next step under each
    layout from it."""
    _, saved = _adamw_step(2, device, 0, save=out / "ckpt-ep2")
    _, ep2_next = _adamw_step(2, device, 1, load=out / "ckpt-ep2")
    ep1_loaded, ep1_next = _adamw_step(1, device, 1, load=out / "ckpt-ep2", save=out / "ckpt-ep1")
    ep2_loaded, _ = _adamw_step(2, device, 2, load=out / "ckpt-ep1")
    return {"saved": saved, "ep1_loaded": ep1_loaded, "ep2_next": ep2_next, "ep1_next": ep1_next,
            "ep2_loaded": ep2_loaded}


def _fsdp_checkpoints(device: torch.device, out: Path) -> dict:
    """dp 4 with FSDP2 at ep 2 (each slice of experts sharded over its 2 expert-data-parallel ranks): a step and a
    checkpoint, loaded at ep 2 FSDP2, at ep 1 DDP and at ep 2 HSDP (2 x 2: each slice replicated over 2 ranks),
    the next step under each; HSDP's checkpoint after its step loaded at ep 1 DDP."""
    _, saved = _adamw_step(2, device, 0, save=out / "ckpt-ep2-fsdp", dp=4, mode="fsdp")
    fsdp_loaded, fsdp_next = _adamw_step(2, device, 1, load=out / "ckpt-ep2-fsdp", dp=4, mode="fsdp")
    ddp_loaded, ddp_next = _adamw_step(1, device, 1, load=out / "ckpt-ep2-fsdp", dp=4, mode="ddp")
    hsdp_loaded, hsdp_next = _adamw_step(2, device, 1, load=out / "ckpt-ep2-fsdp", save=out / "ckpt-ep2-hsdp", dp=4,
                                         mode="hsdp")
    from_hsdp, _ = _adamw_step(1, device, 2, load=out / "ckpt-ep2-hsdp", dp=4, mode="ddp")
    return {"saved": saved, "fsdp_loaded": fsdp_loaded, "fsdp_next": fsdp_next, "ddp_loaded": ddp_loaded,
            "ddp_next": ddp_next, "hsdp_loaded": hsdp_loaded, "hsdp_next": hsdp_next, "from_hsdp": from_hsdp}


def _generations(folder: str, device: torch.device) -> dict[int, torch.Tensor]:
    """Greedy tokens of this rank's replica (rank = replica * 2 + stage) at ep 1 and ep 2: replica r generates
    3 + 3r new tokens for its own two prompts of 5 - r tokens."""
    import torch.distributed as dist

    from pipetrain.generate.job import build_stage
    from pipetrain.generate.loop import Placement, generate_tokens
    from pipetrain.generate.prompts import left_pad
    from pipetrain.generate.sampling import Sampling, Stopping
    from pipetrain.parallel.experts import build_expert_groups
    from pipetrain.parallel.mesh import build_mesh

    model = HFCausalLM.from_folder(folder, seq_len=FOLDER_SEQ)
    rank = dist.get_rank()
    replica = rank // 2
    groups = [dist.new_group([2 * r, 2 * r + 1]) for r in range(2)]
    experts = build_expert_groups(build_mesh(2, 2, device), 2)
    gen = torch.Generator().manual_seed(40 + replica)
    batch = left_pad(torch.randint(1, 90, (2, 5 - replica), generator=gen).tolist(), 0)
    where = Placement(rank, 2, 1, first=2 * replica)
    out = {}
    for ep in (1, 2):
        group = experts.ep_group if ep == 2 else None
        stage = build_stage(model, where, device, expert_group=group)
        route = replace(where.route(groups[replica]), lockstep=group)
        stopping = Stopping(2, eos=None, pad=0, max_new_tokens=3 + 3 * replica)
        out[ep] = generate_tokens({where.stage: stage}, route, batch, Sampling(), stopping,
                                  hidden_size=model.config.hidden_size).tokens
    return out


#: generation at ep 2 x tp 2 (pp 1): replica r's prompts (2 of 5 - r tokens, seed 50 + r) and new tokens
TP_NEW = (4, 7)


def _tp_prompts(replica: int):
    from pipetrain.generate.prompts import left_pad

    gen = torch.Generator().manual_seed(50 + replica)
    return left_pad(torch.randint(1, 90, (2, 5 - replica), generator=gen).tolist(), 0)


def _generations_tp(folder: str, device: torch.device) -> torch.Tensor:
    """Greedy tokens of this rank's replica (rank = replica * 2 + tp rank) at ep 2 x tp 2, pp 1, placed as
    `pipetrain generate --ep 2 --tp 2` places them (`place_rank`): the attention over each replica's TP pair, the
    experts over the EP pair of each TP rank; the folder's EOS (0) ends a sequence, as in transformers' `generate`."""
    import torch.distributed as dist

    from pipetrain.generate.job import GenerateJob, place_rank
    from pipetrain.generate.loop import generate_tokens
    from pipetrain.generate.sampling import Sampling, Stopping
    from pipetrain.generate.weights import ModelSource

    job = GenerateJob(ModelSource(Path(folder)), (), pp=1, tp=2, ep=2)
    model = job.source.model()
    stage, route = place_rank(job, model, dist.get_rank(), device)
    replica = dist.get_rank() // 2
    assert route.lockstep is not None and route.tp == 2 and route.owners == (2 * replica + dist.get_rank() % 2,)
    stopping = Stopping(2, eos=[0], pad=0, max_new_tokens=TP_NEW[replica])
    return generate_tokens({0: stage}, route, _tp_prompts(replica), Sampling(), stopping,
                           hidden_size=model.config.hidden_size).tokens


def _worker(spec: RankSpec, out: str, folders: dict[str, str]) -> None:
    device = join_job(spec)
    try:
        records = {name: _train(parallel, device) for name, parallel in layouts().items()}
        for name in BF16_LAYOUTS:  # under bf16 autocast: ep 2 against ep 1, the same micro-batches
            records[f"{name}-bf16"] = _train(layouts()[name], device, precision="bf16")
        records["checkpoints"] = _checkpoint_round_trips(device, Path(out))
        records["fsdp_checkpoints"] = _fsdp_checkpoints(device, Path(out))
        for family, schedule in FOLDER_CASES:
            records[f"{family}-{schedule}"] = _train_folder(folders[family], schedule, device)
        records["generate"] = _generations(folders["qwen3_moe"], device)
        records["generate-ep2-tp2"] = _generations_tp(folders["qwen3_moe"], device)
        torch.save(records, Path(out) / f"rank{spec.rank}.pt")
    finally:
        close_session()


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe-ep-folders")
    for family in FOLDER_FAMILIES + MORE_FAMILIES:
        moe_folder(root / family, family, seed=moe_parity.SEED)
    return {family: str(root / family) for family in FOLDER_FAMILIES + MORE_FAMILIES}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, folders) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("moe-ep")
    spawn(_worker, ranks=range(4), world_size=4, master_addr="127.0.0.1", master_port=free_port(),
          args=(str(out), folders), timeout_s=900)
    per_rank = [torch.load(out / f"rank{r}.pt") for r in range(4)]
    return {name: [records[name] for records in per_rank] for name in per_rank[0]}


def test_checkpoints_move_between_ep2_and_ep1(runs):
    """A checkpoint of split experts (ep=2) loads at ep=1 (each rank then holds every expert) and back: the loaded
    parameters equal the saved ones, and the next AdamW step from the checkpoint (its moments loaded too) gives the
    same parameters at ep=2 and at ep=1."""
    for record in runs["checkpoints"]:
        for name, value in record["saved"].items():
            torch.testing.assert_close(record["ep1_loaded"][name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
        for name, value in record["ep2_next"].items():
            torch.testing.assert_close(record["ep1_next"][name], value, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{name}: {m}")
            torch.testing.assert_close(record["ep2_loaded"][name], record["ep1_next"][name], rtol=0, atol=0,
                                       msg=lambda m: f"{name}: {m}")
        assert any("experts" in name for name in record["saved"])


def test_fsdp_sharded_experts_checkpoint_and_load_under_another_ep_and_dp_mode(runs):
    """Experts split at ep 2 and sharded by FSDP2 over their expert-data-parallel ranks: the checkpoint loads back
    under FSDP2 at ep 2, under DDP at ep 1 and under HSDP at ep 2 with the saved parameters (and AdamW moments: the
    next steps agree); HSDP's own checkpoint loads under DDP at ep 1 with HSDP's parameters."""
    for record in runs["fsdp_checkpoints"]:
        assert any("experts" in name for name in record["saved"])
        for name, value in record["saved"].items():
            for loaded in ("fsdp_loaded", "ddp_loaded", "hsdp_loaded"):
                torch.testing.assert_close(record[loaded][name], value, rtol=0, atol=0,
                                           msg=lambda m: f"{loaded} {name}: {m}")
            for other in ("ddp_next", "hsdp_next"):
                torch.testing.assert_close(record["fsdp_next"][name], record[other][name], rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"{other} {name}: {m}")
            torch.testing.assert_close(record["from_hsdp"][name], record["hsdp_next"][name], rtol=0, atol=0,
                                       msg=lambda m: f"loaded from hsdp {name}: {m}")


@pytest.fixture(scope="module")
def ref() -> dict:
    return reference()


#: layouts also run under bf16 autocast: ep 2 against ep 1 (dp 2 x pp 2, 1F1B, DDP)
BF16_LAYOUTS = ("ep2-pp2-1f1b", "ep1-dp2-pp2-1f1b")


@pytest.mark.bf16
def test_bf16_expert_parallelism_equals_bf16_at_ep1(runs, ref):
    """Under bf16 autocast the split experts compute what whole ones do: ep 2 against ep 1 at the first step (the
    loss and every gradient, each slice against its rows) within bf16's round-off of the two (the experts' matmuls
    see other batch shapes). Later steps are not compared: after an update in bf16 a router's near-tie can go the
    other way at one ep and not the other. bf16 is really used: far from the fp32 run."""
    ep2, ep1 = runs["ep2-pp2-1f1b-bf16"], runs["ep1-dp2-pp2-1f1b-bf16"]
    worst, off_fp32 = 0.0, 0.0
    for split, whole in zip(ep2, ep1):
        torch.testing.assert_close(split["losses"][0], whole["losses"][0], rtol=BF16_RTOL, atol=BF16_ATOL)
        for name, grad in split["grads"][0].items():
            expected = _expected(whole["grads"][0][name], split["slices"][name])
            worst = max(worst, (grad - expected).abs().max().item())
            torch.testing.assert_close(grad, expected, rtol=BF16_RTOL, atol=BF16_ATOL,
                                       msg=lambda m: f"step 0 gradient of {name}: {m}")
            off_fp32 = max(off_fp32, (whole["grads"][0][name] - ref["grads"][0][name]).abs().max().item())
    print(f"bf16 ep2 vs ep1, step 0: largest gradient difference {worst:.2e}; bf16 vs fp32 {off_fp32:.2e}")
    assert off_fp32 > 5 * BF16_ATOL, "the bf16 runs are no different from fp32: bf16 was not used"


def _expected(value: torch.Tensor, where: tuple[int, int] | None) -> torch.Tensor:
    return value if where is None else value[where[0]:where[0] + where[1]]


@pytest.mark.parametrize("layout", list(layouts()))
def test_expert_parallel_pipeline_matches_the_unsplit_model(layout, runs, ref):
    seen, experts_split = set(), False
    for record in runs[layout]:
        torch.testing.assert_close(torch.tensor(record["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(record["eval"], ref["eval"], rtol=RTOL, atol=ATOL)
        # the global gradient norm (what --clip-grad clips by) counts every expert slice once
        torch.testing.assert_close(torch.tensor(record["norms"]), torch.tensor(ref["norms"]), rtol=RTOL, atol=ATOL)
        for step, grads in enumerate(record["grads"]):
            for name, grad in grads.items():
                expected = _expected(ref["grads"][step][name], record["slices"][name])
                torch.testing.assert_close(grad, expected, rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"step {step} gradient of {name}: {m}")
        for name, value in record["params"].items():
            torch.testing.assert_close(value, _expected(ref["params"][name], record["slices"][name]), rtol=RTOL,
                                       atol=ATOL, msg=lambda m: f"parameter {name}: {m}")
            where = record["slices"][name]
            seen.add(name if where is None else f"{name}[{where[0]}]")
            experts_split |= where is not None and where[1] < EXPERTS
    expected_names = {n if "experts" not in n or layout.startswith("ep1") else f"{n}[{first}]"
                      for n in ref["params"] for first in (0, 2)}
    assert seen == expected_names  # every parameter (each expert slice) held somewhere
    assert experts_split == layout.startswith("ep2")


OVERLAPPED = ("ep2-pp2-dualpipev-fsdp-overlap", "ep2-pp2-dualpipev-fsdp-overlap-recompute")


@pytest.mark.parametrize("layout", OVERLAPPED)
def test_overlapped_dualpipev_is_bitwise_the_run_in_turn(layout, runs):
    """DualPipeV's fused actions run in two threads (counted: the overlap ran) give exactly (rtol 0, atol 0) the
    losses, gradients and parameters of the same schedule run one action after the other."""
    for record, plain in zip(runs[layout], runs["ep2-pp2-dualpipev-fsdp"], strict=True):
        assert record["overlapped"] > 0 and plain["overlapped"] == 0
        assert record["losses"] == plain["losses"]
        for step, grads in enumerate(record["grads"]):
            for name, grad in grads.items():
                torch.testing.assert_close(grad, plain["grads"][step][name], rtol=0, atol=0,
                                           msg=lambda m: f"step {step} gradient of {name}: {m}")
        for name, value in record["params"].items():
            torch.testing.assert_close(value, plain["params"][name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_moe_overlap_without_dualpipev_or_experts_split_is_refused():
    with pytest.raises(ConfigError, match="--moe-overlap on overlaps DualPipeV's fused .* schedule '1f1b' has none"):
        PipelineConfig(pp=2, schedule="1f1b", n_microbatches=2, moe_overlap=True)
    with pytest.raises(ConfigError, match="--moe-overlap on hides the experts' all-to-all .* with ep=1 there is none"):
        ParallelConfig(dp=2, dp_mode="fsdp", pipeline=PipelineConfig(pp=2, schedule="dualpipev", n_microbatches=4,
                                                                       moe_overlap=True))


def test_ep_on_a_dense_model_is_refused():
    class Dense(TinyMoE):
        def __init__(self) -> None:
            super().__init__(mlp_only_layers=[0, 1, 2, 3])

    with pytest.raises(ConfigError, match="--ep 2 splits the experts of MoE layers, but the model Dense has none"):
        check_expert_parallel(Dense(), 2)


def test_ep_not_dividing_the_experts_is_refused_before_any_rank_starts():
    with pytest.raises(ConfigError, match="--ep 3 does not divide the 4 experts"):
        check_expert_parallel(TinyMoE(), 3)
    check_expert_parallel(TinyMoE(), 2)


def test_ep_not_dividing_the_stage_ranks_is_refused():
    with pytest.raises(ConfigError, match=r"--ep 2 does not divide the 3 data-parallel ranks of each stage"):
        ParallelConfig(dp=3, ep=2, pipeline=PipelineConfig(pp=2))


@pytest.fixture(scope="module")
def family_references(folders):
    """(family, dp) -> transformers' reference of the family's folder (`moe_parity.reference`), computed once: a
    family's schedules at one dp compare with the same one (the tests only read it)."""
    found: dict[tuple[str, int], dict] = {}

    def get(family: str, dp: int) -> dict:
        if (family, dp) not in found:
            model = transformers.AutoModelForCausalLM.from_pretrained(folders[family])
            found[family, dp] = moe_parity.reference(model, dp)
        return found[family, dp]
    return get


@pytest.mark.parametrize(("family", "schedule"), FOLDER_CASES)
def test_expert_parallel_moe_family_matches_unsplit_transformers(family, schedule, runs, family_references):
    dp = 4 if (family, schedule) == HSDP_CASE else 2
    ref = family_references(family, dp)
    seen, split, tp_split = set(), 0, False
    for record in runs[f"{family}-{schedule}"]:
        torch.testing.assert_close(torch.tensor(record["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=ATOL)
        slices = record["slices"]
        for step, grads in enumerate(record["grads"]):
            for name, grad in grads:
                torch.testing.assert_close(grad, _expected(ref["grads"][step][name], slices[name]), rtol=RTOL,
                                           atol=ATOL, msg=lambda m: f"step {step} gradient of {name}: {m}")
        for name, value in record["params"]:
            torch.testing.assert_close(value, _expected(ref["params"][name], slices[name]), rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"parameter {name}: {m}")
            seen.add(name)
            split += slices[name] is not None
            tp_split |= name in record["tp_split"]
    assert seen == set(ref["params"])
    assert split  # experts were split
    assert tp_split == (schedule == "tp2-fsdp")  # and the attention over the TP pair


def test_generation_with_experts_split_gives_the_tokens_of_ep1(runs):
    for rank, record in enumerate(runs["generate"]):
        assert record[1].shape == (2, 3 + 3 * (rank // 2))  # each replica its own length, though they stepped together
        assert torch.equal(record[2], record[1])


def test_generation_at_ep2_tp2_gives_transformers_tokens(runs, folders):
    """`generate --ep 2 --tp 2` (pp 1): each replica's greedy tokens equal transformers' `generate` on the unsplit
    Qwen3-MoE folder (exact), though the two replicas ask for other numbers of new tokens and step together."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folders["qwen3_moe"]).eval()
    for rank, tokens in enumerate(runs["generate-ep2-tp2"]):
        batch = _tp_prompts(rank // 2)
        out = model.generate(batch.ids, attention_mask=batch.mask, max_new_tokens=TP_NEW[rank // 2],
                             do_sample=False, pad_token_id=0)
        expected = out[:, batch.ids.shape[1]:]
        assert torch.equal(tokens, expected), f"rank {rank}:\n{tokens}\n!= transformers'\n{expected}"

"""The layout settled before any rank starts, read from the job description and returned as a new one (`replace`):
`--layout auto` (the planner's choice within the flags given) and the split of `--partition time|memory`.

Where the figures come from: block costs from `--profile FILE`; else, for a Hugging Face folder (`--workload hf
--model DIR`) of a family the planner prices, from its config.json alone (`plan.transformer`: the same pricing as
`pipetrain plan --model`, deterministic, so launched ranks need no profile); else measured here at several
micro-batch sizes (fixed + per-sample fit). The device and network from `--calibration FILE` (default: this
machine's stored one), else measured here first. Both are said, with how long they took. Ranks started by a launcher (torchrun, srun)
decide from the files alone, so every rank computes the same choice: there they need both files.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from pipetrain.blocks import BlockModel
from pipetrain.checkpoint.keys import fingerprint
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.errors import ConfigError
from pipetrain.partition import cost_balance
from pipetrain.partition.profile import load_profile
from pipetrain.partition.solver import solve_balance
from pipetrain.partition.stagecost import COST_METHODS, check_mem_cap
from pipetrain.pipeline.runs import plan_runs
from pipetrain.plan.auto import AutoChoice, choose_layout, layout_flags
from pipetrain.plan.hardware import Calibration, default_calibration_path, load_calibration, save_calibration
from pipetrain.plan.loss import with_loss
from pipetrain.plan.model import BlockCost
from pipetrain.plan.predict import Layout, predict
from pipetrain.plan.resize import Saved, decide
from pipetrain.plan.transformer import load_sizes
from pipetrain.train.config import LayoutRequest, TrainConfig
from pipetrain.workloads.classifier.presets import PRESETS, TransformerConfig

__all__ = ["auto_layout", "balanced", "check_resize_files", "Calibrate"]

log = logging.getLogger("pipetrain")
_MB = 2**20

#: Measures this machine: `calibrate(layer_shape, device=..., precision=...)` (`pipetrain.bench.calibrate`).
Calibrate = Callable[..., Calibration]


def _layer_shape(config: TrainConfig) -> dict:
    """The encoder layer calibration times: the job's preset when it is a Transformer's sizes, else the cpu one."""
    sizes = config.task().presets.get(config.preset)
    c = sizes if isinstance(sizes, TransformerConfig) else PRESETS["cpu"]
    return dict(seq_len=c.seq_len, emsize=c.emsize, nhead=c.nhead, nhid=c.nhid, dropout=c.dropout)


def _calibration(config: TrainConfig, launched: bool, device: str, say: bool,
                 calibrate: Calibrate | None) -> tuple[Calibration, str]:
    path = config.layout.calibration or default_calibration_path()
    if not path.exists():
        if launched or calibrate is None:
            raise ConfigError(f"--layout auto on ranks started by a launcher needs a calibration file; {str(path)!r} "
                              "is missing (each rank measuring on its own could choose differently)",
                              hint="measure it first with `pipetrain plan --calibrate --gpus 2`, or pass --calibration")
        if say:
            log.info("pipetrain: --layout auto: no calibration at %s: measuring this machine first (2 ranks, "
                     "about 30 s)", path)
        start = time.perf_counter()
        measured = calibrate(_layer_shape(config), device=device,
                             precision="fp32-strict" if config.precision == "fp32-strict" else "fp32")
        save_calibration(measured, path)
        return measured, f"measured now in {time.perf_counter() - start:.0f} s, stored in {path}"
    return load_calibration(path), f"{path} ({load_calibration(path).measured.split(',')[0]})"


def _blocks(config: TrainConfig, model: BlockModel, launched: bool, device: str,
            say: bool) -> tuple[list[BlockCost], str]:
    from pipetrain.partition.measure import default_sizes, model_fingerprint
    from pipetrain.plan.model import profile_blocks
    from pipetrain.train.profiling import measure_profile

    given = config.layout.profile
    analytic = _analytic_blocks(config, model) if given is None else None
    if analytic is not None:
        return analytic
    if given is not None:
        profile = load_profile(given)
        if profile.fingerprint != model_fingerprint(model):
            raise ConfigError(f"the profile {str(given)!r} is of another model ({profile.model!r})",
                              hint="profile this model with `pipetrain profile` (same workload and preset)")
        source = f"profile {given} ({profile.describe()})"
    elif launched:
        raise ConfigError("--layout auto on ranks started by a launcher needs --profile FILE (each rank measuring "
                          "on its own could choose differently)",
                          hint="write one first with `pipetrain profile --output FILE` and pass --profile FILE")
    else:
        sizes = default_sizes(min(16, config.batch_size))
        if say:
            log.info("pipetrain: --layout auto: measuring each block at micro-batch sizes %s (pass --profile FILE "
                     "to reuse a profile)", ", ".join(map(str, sizes)))
        start = time.perf_counter()
        profile = measure_profile(model, sizes, device=device, repeats=3)
        source = f"measured now in {time.perf_counter() - start:.1f} s ({profile.describe()})"
    return with_loss(profile_blocks(profile), config.task().loss()), source


def _analytic_blocks(config: TrainConfig, model: BlockModel) -> tuple[list[BlockCost], str] | None:
    """The analytic costs of a `--model DIR` job whose family the planner prices, or None (measure instead)."""
    if config.model_dir is None:
        return None
    try:
        sizes = load_sizes(config.model_dir)
    except ConfigError:  # a family the adapter splits but the planner cannot price: measure it
        return None
    seq_len = config.window
    blocks = sizes.blocks(seq_len, element=2 if config.precision == "bf16" else 4)
    if len(blocks) != getattr(model, "num_blocks", len(blocks)):
        return None
    return blocks, f"{config.model_dir}/config.json priced at seq len {seq_len} ({sizes.summary()})"


def frozen_costs(blocks: list[BlockCost], model: BlockModel) -> list[BlockCost]:
    """`blocks` with each block's frozen parameters counted (`BlockCost.frozen_params`: a LoRA run's base gets no
    gradient nor optimizer state), from the model's blocks built on the meta device. Priced from a config (the base
    alone), a block's parameters gain its adapters'."""
    out = []
    for index, cost in enumerate(blocks):
        with torch.device("meta"):
            params = list(model.build_block(index).parameters())
        total = sum(p.numel() for p in params)
        trained = sum(p.numel() for p in params if p.requires_grad)
        if trained == total:
            out.append(cost)
            continue
        count = cost.params + trained if cost.params < total else cost.params
        scale = count / cost.params if cost.params else 1.0
        out.append(replace(cost, params=count, param_bytes=cost.param_bytes * scale, frozen_params=count - trained))
    return out


def _accepts(num_blocks: int) -> Callable[[Layout], bool]:
    def accepts(layout: Layout) -> bool:
        try:
            pipeline = PipelineConfig(pp=layout.pp, schedule=layout.schedule, n_microbatches=layout.chunks,
                                      checkpoint=layout.checkpoint, recompute_unit=layout.recompute_unit,
                                      stages_per_rank=layout.virtual if layout.virtual > 1 else None)
            pipeline.check_blocks(num_blocks)
            ParallelConfig(dp=layout.dp, dp_mode=layout.dp_mode, pipeline=pipeline, ep=layout.ep, cp=layout.cp,
                           cp_attention=layout.cp_attention,
                           dp_shard=layout.dp_shard if layout.dp_mode == "hsdp" else None)
        except ConfigError:
            return False
        return True
    return accepts


def auto_layout(config: TrainConfig, *, world: int, per_node: int, device: str, launched: bool, say: bool,
                calibrate: Calibrate | None = None, saved: Saved | None = None) -> TrainConfig:
    """`config` with the layout `--layout auto` chooses for `world` ranks, `per_node` on each node (logged when
    `say`, with the prediction, which `logs.predicted` then carries to the run log); `config` itself without
    `--layout auto`. `launched`: ranks started by a launcher, which decide from the files alone; `calibrate`
    measures this machine when the calibration file is missing. `saved`: the checkpoint the job resumes; when it was
    written by another number of ranks, `--on-resize` (`config.layout.on_resize`) decides (`plan.resize.decide`)."""
    request = config.layout
    if not request.auto:
        return config
    calib, calib_source = _calibration(config, launched, device, say, calibrate)
    model = config.model()
    blocks, blocks_source = _blocks(config, model, launched, device, say)
    blocks = frozen_costs(blocks, model)
    if (request.fixed.cp or 1) > 1 and not any(block.context is not None for block in blocks):
        raise ConfigError(f"--layout auto with --cp {request.fixed.cp} prices the attention a context-parallel split "
                          f"exchanges, which these block costs do not hold ({blocks_source})",
                          hint="pass a folder the planner prices (--workload hf --model DIR), or drop --layout auto "
                               "and give the layout flags")
    memory = request.mem_cap * _MB if request.mem_cap is not None else (
        calib.device.memory_bytes / max(1, per_node) if calib.device.cores else calib.device.memory_bytes)
    budget = replace(calib.device, memory_bytes=memory)
    precision = "bf16" if config.precision == "bf16" else "fp32"

    def choose(ranks: int) -> AutoChoice:
        return choose_layout(blocks, world=ranks, batch=config.batch_size, network=calib.network, fixed=request.fixed,
                             device=budget, gpus_per_node=per_node if per_node < ranks else 0,
                             accepts=_accepts(len(blocks)), precision=precision)

    def price(layout: Layout) -> float | None:
        try:
            return predict(blocks, replace(layout, batch=config.batch_size, precision=precision,
                                           gpus_per_node=per_node if per_node < layout.world_size else 0),
                           budget, calib.network).step_s
        except (ConfigError, ValueError, KeyError):  # a layout the planner does not price (e.g. tp): no ratio
            return None

    resize = None
    if saved is not None:
        resize = decide(saved, world=world, policy=request.on_resize, model=config.model_name(),
                        fingerprint=fingerprint(config.model()), choose=lambda ranks: choose(ranks).prediction,
                        price=price, fixed=request.fixed)
    choice = choose(world)
    best = choice.prediction
    lay = best.layout
    pipeline = replace(config.parallel.pipeline, pp=lay.pp, schedule=lay.schedule, n_microbatches=lay.chunks,
                       checkpoint=lay.checkpoint, recompute_unit=lay.recompute_unit,
                       recompute_every=lay.recompute_every, offload_activations=lay.offload,
                       selective_matmuls=lay.selective_matmuls,
                       stages_per_rank=lay.virtual if lay.virtual > 1 else None,
                       balance=tuple(best.balance) if lay.pp * lay.virtual > 1 else None, partition="uniform",
                       # searched (or fixed by --moe-overlap on|off where it applies: DualPipeV, experts split)
                       moe_overlap=lay.moe_overlap)
    if say:
        if resize is not None:
            log.info("pipetrain: --on-resize auto: %s (resuming %s)", resize.line(), saved.folder)
        log.info("pipetrain: --layout auto chose %s for %d ranks, global batch %d (%d layouts predicted)",
                 " ".join(layout_flags(best)), world, config.batch_size, choice.considered)
        log.info("pipetrain: predicted %.3f s/step, memory per rank %s MB (budget %.0f MB); block costs: %s; "
                 "device and network: %s", best.step_s, "/".join(f"{m / _MB:.0f}" for m in best.memory_bytes),
                 memory / _MB, blocks_source, calib_source)
    reshard = "always" if lay.fsdp_reshard and lay.shards > 1 and lay.dp > 1 else "never"
    return replace(config, parallel=replace(config.parallel, dp=lay.dp, dp_mode=lay.dp_mode, pipeline=pipeline,
                                            fsdp_reshard=reshard, ep=lay.ep, cp=lay.cp,
                                            cp_attention=lay.cp_attention,
                                            dp_shard=lay.dp_shard if lay.dp_mode == "hsdp" else None),
                   layout=LayoutRequest(),  # the split is chosen: nothing left to balance
                   logs=replace(config.logs, predicted=(best.step_s, best.memory_bytes[0] / _MB)))


def _priced(config: TrainConfig, say: bool) -> TrainConfig:
    """`config` split by `--partition priced`: the stages' forward FLOPs balanced (`solve_balance`), as the planner
    prices the folder's blocks from its config.json (the same on every rank: nothing is measured)."""
    pipeline = config.parallel.pipeline
    if pipeline.balance is not None:
        raise ConfigError(f"--balance {','.join(map(str, pipeline.balance))} and --partition priced both choose the "
                          "split", hint="pass one of them")
    priced = _analytic_blocks(config, config.model())
    if priced is None:
        raise ConfigError(f"--partition priced needs a --model DIR whose family the planner prices and whose blocks "
                          f"it counts as the model does ({config.model_dir or 'no folder'})",
                          hint="pass --partition time (measured costs) or uniform")
    blocks, source = priced
    balance = tuple(solve_balance([b.forward_flops for b in blocks], pipeline.num_stages))
    if say:
        log.info("pipetrain: --partition priced: blocks per stage %s (forward FLOPs of %s)",
                 ",".join(map(str, balance)), source)
    return replace(config, parallel=replace(config.parallel, pipeline=replace(pipeline, balance=balance,
                                                                              partition="uniform")))


def check_resize_files(config: TrainConfig) -> None:
    """`--on-resize auto` on launched ranks: the files a restart's re-layout needs are there before training starts
    (a restart would else stop on them, hours later)."""
    request = config.layout
    if request.on_resize != "auto" or request.auto:
        return
    calibration = request.calibration or default_calibration_path()
    if not calibration.exists():
        raise ConfigError(f"--on-resize auto on ranks started by a launcher needs a calibration file; "
                          f"{str(calibration)!r} is missing (a restart lays out its ranks from it)",
                          hint="measure it first with `pipetrain plan --calibrate --gpus 2`, or pass --calibration")
    if request.profile is None and config.model_dir is None:
        raise ConfigError("--on-resize auto on ranks started by a launcher needs --profile FILE (a restart lays out "
                          "its ranks from the block costs, the same on every rank)",
                          hint="write one first with `pipetrain profile --output FILE` and pass --profile FILE")


def balanced(config: TrainConfig, *, device: str, launched: bool, say: bool = True) -> TrainConfig:
    """`config` with the balance `--partition time|memory` (and `--mem-cap`) chooses from measured block costs.

    Costs come from `--profile`, else the blocks are measured here on `device` (not on a launched rank: every rank
    must split the model the same way, so ranks started by torchrun or srun need `--profile`).
    """
    pipeline, request = config.parallel.pipeline, config.layout
    if pipeline.partition == "priced":
        return _priced(config, say)
    if pipeline.partition not in COST_METHODS:
        profile = request.profile if request.on_resize != "auto" else None  # kept for a re-layout
        for flag, value in (("--mem-cap", request.mem_cap), ("--profile", profile)):
            if value is not None:
                raise ConfigError(f"{flag} is only used by --partition time|memory, not {pipeline.partition!r}",
                                  hint=f"add --partition time, or drop {flag}")
        return config
    if pipeline.balance is not None:
        raise ConfigError(f"--balance {','.join(map(str, pipeline.balance))} and --partition {pipeline.partition} "
                          "both choose the split", hint="pass one of them")
    if request.profile is None and launched:
        raise ConfigError(f"--partition {pipeline.partition} on ranks started by a launcher needs --profile FILE "
                          "(each rank measuring on its own could split the model differently)",
                          hint="write one first with `pipetrain profile --output FILE` and pass --profile FILE")
    check_mem_cap(pipeline.partition, request.mem_cap)
    profile = load_profile(request.profile) if request.profile is not None else None
    micro = plan_runs(config.batch_size // config.parallel.dp, pipeline.n_microbatches)[0].size
    if say and profile is None:
        log.info("pipetrain: measuring each block at micro-batch size %d for --partition %s "
                 "(pass --profile FILE to reuse a profile)", micro, pipeline.partition)
    pipeline, choice = cost_balance(config.model(), pipeline, micro_batch_size=micro, profile=profile,
                                    mem_cap_mb=request.mem_cap, profile_source=f"the profile {str(request.profile)!r}",
                                    device=device if profile is None else "cpu")  # the job's device
    if say:
        for line in choice.lines():
            log.info("pipetrain: %s", line)
    return replace(config, parallel=replace(config.parallel, pipeline=pipeline))

"""Frozen, keyword-only configuration dataclasses, one per component, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from pipetrain.errors import ConfigError

__all__ = [
    "SCHEDULES",
    "CHECKPOINT_POLICIES",
    "DP_MODES",
    "PARTITION_METHODS",
    "PipelineConfig",
    "ParallelConfig",
    "schedule_is_multi_stage",
    "V_SCHEDULES",
    "SPLIT_BACKWARD_SCHEDULES",
    "CP_ATTENTIONS",
    "RECOMPUTE_UNITS",
    "FSDP_RESHARD",
    "SHARDED_DP_MODES",
]

#: Schedule name -> number of stages each pipeline rank holds by default.
SCHEDULES: dict[str, int] = {
    "gpipe": 1,
    "1f1b": 1,
    "interleaved-1f1b": 2,
    "zero-bubble": 2,
    "zbv": 2,
    "dualpipev": 2,
}
#: The V-shaped schedules: pipeline rank r of p holds stages r and 2p - 1 - r (the others: r, r + p, ...).
V_SCHEDULES = ("zbv", "dualpipev")
#: The schedules that split a backward into its input and weight parts (and DDP cannot run: see ParallelConfig).
SPLIT_BACKWARD_SCHEDULES = ("zero-bubble", "zbv", "dualpipev")
CHECKPOINT_POLICIES = ("never", "except_last", "always")
#: `--cp-attention`: how attention sees a sequence cut over the context-parallel ranks (pipetrain.context)
CP_ATTENTIONS = ("ring", "ulysses")
DP_MODES = ("ddp", "fsdp", "hsdp")
#: the data-parallel modes that shard parameters with FSDP2 (hsdp: replicated across groups, sharded within)
SHARDED_DP_MODES = ("fsdp", "hsdp")
#: what one recomputation checkpoints: the whole stage, each block (`layer`), or each block's cheap ops only
RECOMPUTE_UNITS = ("stage", "layer", "selective")
#: `--fsdp-reshard` words (an integer N >= 2 is also accepted: reshard to groups of N ranks after forward)
FSDP_RESHARD = ("never", "always", "auto")
PARTITION_METHODS = ("parameters", "uniform", "time", "memory", "priced")


def schedule_is_multi_stage(schedule: str) -> bool:
    """True for the schedules that put several (virtual) stages on each rank."""
    return SCHEDULES[schedule] > 1


def _choice(name: str, value: str, allowed: tuple[str, ...] | dict[str, int]) -> None:
    if value not in allowed:
        raise ConfigError(
            f"unknown {name} {value!r}", hint=f"choose one of: {', '.join(allowed)}"
        )


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}", hint=f"pass {name} >= 1")


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """How the model is cut and scheduled across the `pp` ranks of one pipeline.

    `n_microbatches` is the IDRIS pages' "chunks": 1 is naive model parallelism.
    `balance`, when given, is the number of blocks of each stage (pp * stages_per_rank entries).
    `shape_cache` bounds the schedules kept, one per micro-batch shape (e.g. sequence length); the least
    recently used is rebuilt when needed again.
    `compile` compiles each block with `torch.compile` (not with the split-backward schedules).
    `deferred_batchnorm` updates the running statistics of BatchNorm layers once per step, from the whole
    mini-batch, instead of once per micro-batch (torchgpipe's `deferred_batch_norm`; see docs/batchnorm.md).
    """

    pp: int = 1
    schedule: str = "gpipe"
    n_microbatches: int = 1
    checkpoint: str = "never"
    stages_per_rank: int | None = None
    balance: tuple[int, ...] | None = None
    partition: str = "uniform"
    shape_cache: int = 16
    #: `torch.compile` each block of each local stage (`--compile`, see `pipeline/compiled.py`); `compile_dynamic`
    #: is passed as `torch.compile(dynamic=)`: None (torch's automatic dynamic shapes) or True (every dimension
    #: symbolic, for lengths that vary per batch: `TrainConfig` sets it when batches are bucketed)
    compile: bool = False
    compile_dynamic: bool | None = None
    #: BatchNorm running statistics accumulated over a step's micro-batches, committed once (`--deferred-batchnorm`)
    deferred_batchnorm: bool = False
    #: what a recomputing micro-batch checkpoints (`--recompute-unit`; see pipeline/recompute.py): "stage" (the
    #: whole stage, keeping its input), "layer" (each block, keeping every block's input) or "selective" (each
    #: block keeps its matrix products' and attention's outputs and recomputes the cheap ops)
    recompute_unit: str = "stage"
    #: with unit "layer" or "selective": only every K-th block of the model recomputes (`--recompute-every`)
    recompute_every: int = 1
    #: saved activations of micro-batches waiting for their backward go to pinned host memory
    #: (`--offload-activations`, pipeline/offload.py; CUDA only, a no-op that says so on the CPU)
    offload_activations: bool = False
    #: DualPipeV's fused actions (a forward of one micro-batch with a backward of another) run concurrently, the
    #: forward here and the backward in a second thread, so that one's expert all-to-all waits while the other
    #: computes (`--moe-overlap on`; `compat.overlap`); needs expert parallelism (`ParallelConfig.ep` > 1)
    moe_overlap: bool = False

    def __post_init__(self) -> None:
        _positive("pp", self.pp)
        _positive("shape_cache (--shape-cache)", self.shape_cache)
        _positive("n_microbatches (--chunks)", self.n_microbatches)
        _choice("schedule", self.schedule, SCHEDULES)
        _choice("checkpoint policy", self.checkpoint, CHECKPOINT_POLICIES)
        _choice("partition method", self.partition, PARTITION_METHODS)
        _choice("recomputation unit (--recompute-unit)", self.recompute_unit, RECOMPUTE_UNITS)
        _positive("recompute_every (--recompute-every)", self.recompute_every)
        if self.recompute_every > 1 and self.recompute_unit == "stage":
            raise ConfigError(f"--recompute-every {self.recompute_every} picks blocks, but the recomputation unit is "
                              "the whole stage", hint="add --recompute-unit layer (or selective)")
        if self.recompute_unit != "stage" and self.checkpoint == "never":
            raise ConfigError(f"--recompute-unit {self.recompute_unit} with --checkpoint never: nothing recomputes",
                              hint="add --checkpoint always (or except_last), or drop --recompute-unit")
        if self.stages_per_rank is not None:
            _positive("stages_per_rank", self.stages_per_rank)
            if self.stages_per_rank > 1 and not schedule_is_multi_stage(self.schedule):
                raise ConfigError(
                    f"schedule {self.schedule!r} runs one stage per rank, got stages_per_rank={self.stages_per_rank}",
                    hint="use --schedule interleaved-1f1b or zero-bubble for virtual stages",
                )
            if self.schedule in V_SCHEDULES and self.stages_per_rank != 2:
                raise ConfigError(
                    f"schedule {self.schedule!r} holds exactly 2 stages per rank (a V), got "
                    f"stages_per_rank={self.stages_per_rank}",
                    hint="leave stages_per_rank unset, or use --schedule interleaved-1f1b for more stages per rank",
                )
            if self.stages_per_rank < 2 and schedule_is_multi_stage(self.schedule):
                raise ConfigError(
                    f"schedule {self.schedule!r} needs at least 2 stages per rank, got {self.stages_per_rank}",
                    hint="leave stages_per_rank unset or pass 2 or more",
                )
        if self.compile and self.schedule in SPLIT_BACKWARD_SCHEDULES:
            # torch 2.13 (pytorch/pytorch#161904), verified on gloo at pp=2 for zero-bubble, zbv and dualpipev: the
            # input half of the split backward (stage_backward_input, retain_graph=True) fails in every compiled
            # block with "This backward function was compiled with non-empty donated buffers which requires
            # create_graph=False and retain_graph=False"; a compiled block is one autograd node, so even without
            # donated buffers its weight half could not be run apart from its input half
            raise ConfigError(
                f"--compile with schedule {self.schedule!r}: torch 2.13 cannot split the backward of compiled "
                "blocks into input and weight parts, which this schedule needs (pytorch/pytorch#161904)",
                hint="drop --compile, or use --schedule 1f1b, gpipe or interleaved-1f1b",
            )
        if self.compile and self.deferred_batchnorm:
            raise ConfigError(
                "--deferred-batchnorm with --compile: the deferred statistics are recorded by a Python hook on each "
                "BatchNorm layer, which a compiled block would trace into its graph",
                hint="drop --compile, or drop --deferred-batchnorm (running statistics then follow each micro-batch)",
            )
        if self.schedule == "1f1b" and self.n_microbatches < self.pp:
            raise ConfigError(
                f"schedule '1f1b' needs at least as many micro-batches as stages: "
                f"chunks={self.n_microbatches} < pp={self.pp}",
                hint=f"pass --chunks {self.pp} or more, or use --schedule gpipe",
            )
        if self.moe_overlap and self.schedule != "dualpipev":
            raise ConfigError(f"--moe-overlap on overlaps DualPipeV's fused forward-and-backward actions; schedule "
                              f"{self.schedule!r} has none", hint="pass --schedule dualpipev, or --moe-overlap off")
        if self.schedule == "dualpipev" and (self.n_microbatches % 2 or self.n_microbatches < 2 * self.pp):
            raise ConfigError(
                f"schedule 'dualpipev' needs an even number of micro-batches, at least 2 x pp = {2 * self.pp}: "
                f"got chunks={self.n_microbatches}",
                hint=f"pass --chunks {max(2 * self.pp, self.n_microbatches + self.n_microbatches % 2)}",
            )
        if (schedule_is_multi_stage(self.schedule) and self.schedule not in V_SCHEDULES
                and self.n_microbatches % self.pp):
            raise ConfigError(
                f"schedule {self.schedule!r} needs chunks to be a multiple of pp: "
                f"chunks={self.n_microbatches}, pp={self.pp}",
                hint=f"pass --chunks {self.pp * max(1, self.n_microbatches // self.pp)}",
            )
        if self.balance is not None:
            if len(self.balance) != self.num_stages:
                raise ConfigError(
                    f"balance {list(self.balance)} has {len(self.balance)} entries for {self.num_stages} stages",
                    hint=f"give one block count per stage ({self.num_stages} numbers)",
                )
            if any((not isinstance(b, int)) or b < 1 for b in self.balance):
                raise ConfigError(
                    f"balance {list(self.balance)} has a stage with no block",
                    hint="every stage needs at least one block",
                )

    @property
    def recompute_text(self) -> str:
        """The recomputation in words: the policy, its unit and frequency, offloading ("always (selective)")."""
        unit = "" if self.recompute_unit == "stage" or self.checkpoint == "never" else (
            f" ({self.recompute_unit}" + (f" every {self.recompute_every}" if self.recompute_every > 1 else "") + ")")
        return self.checkpoint + unit + (", offloading activations" if self.offload_activations else "")

    @property
    def virtual_stages(self) -> int:
        """Stages held by each pipeline rank."""
        return self.stages_per_rank or SCHEDULES[self.schedule]

    @property
    def num_stages(self) -> int:
        """Stages in the whole pipeline."""
        return self.pp * self.virtual_stages

    def stage_ids(self, pp_rank: int) -> list[int]:
        """The stages pipeline rank `pp_rank` holds, in order: a V (r, 2p - 1 - r) under the V schedules, else
        looped (r, r + p, ...)."""
        if self.schedule in V_SCHEDULES:
            return [pp_rank, 2 * self.pp - 1 - pp_rank]
        return [pp_rank + v * self.pp for v in range(self.virtual_stages)]

    def check_blocks(self, num_blocks: int) -> None:
        """Raise if the model has too few blocks for this pipeline, or a balance of the wrong total."""
        if num_blocks < self.num_stages:
            raise ConfigError(
                f"pp={self.pp} with {self.virtual_stages} stage(s) per rank needs {self.num_stages} blocks, "
                f"but the model has {num_blocks}",
                hint=f"use --pp {max(1, num_blocks // self.virtual_stages)} or fewer, or a deeper model",
            )
        if self.balance is not None and sum(self.balance) != num_blocks:
            raise ConfigError(
                f"balance {list(self.balance)} sums to {sum(self.balance)} but the model has {num_blocks} blocks",
                hint="make the block counts add up to the number of blocks",
            )

    def check_batch(self, batch_size: int) -> None:
        """Raise if a batch cannot be cut into this many micro-batches."""
        if self.n_microbatches > batch_size:
            raise ConfigError(
                f"chunks={self.n_microbatches} is larger than the batch size {batch_size}",
                hint=f"pass --chunks {batch_size} or fewer, or a larger --batch-size",
            )


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """The device mesh: `dp` replicas (or shards) of a `pp`-rank pipeline whose every stage is split over `tp`
    ranks (tensor parallelism, innermost: the ranks of a TP group are neighbours); world size = dp * pp * tp.

    `sequence_parallel` (needs tp > 1) also splits the norm and dropout regions along the sequence;
    `loss_parallel` (needs tp > 1) splits a language model's head over the vocabulary, with the cross-entropy
    computed on the shards (`torch.distributed.tensor.parallel.loss_parallel`).
    `ep` (expert parallelism, docs/moe-ep.md) splits each MoE layer's experts over `ep` of a stage's `dp` ranks
    (it borrows them: the world size stays dp * pp * tp); `ep` divides dp.
    `cp` (context parallelism, docs/long-context.md) cuts each sequence over `cp` ranks of every stage, attention
    by `cp_attention` ("ring" or "ulysses"); world size = dp * pp * cp * tp.
    """

    dp: int = 1
    dp_mode: str = "ddp"
    pipeline: PipelineConfig = PipelineConfig()
    tp: int = 1
    sequence_parallel: bool = False
    loss_parallel: bool = False
    #: FSDP2's `reshard_after_forward` per stage (`--fsdp-reshard`): "never" (weights stay gathered from forward
    #: to backward), "always", "auto" (`parallel.reshard.reshard_choice`) or an int N (reshard to groups of N ranks)
    fsdp_reshard: str | int = "never"
    #: with `dp_mode="hsdp"`: ranks of one shard group (`--dp-shard`; dp / dp_shard replicas of it)
    dp_shard: int | None = None
    cp: int = 1
    cp_attention: str = "ring"
    ep: int = 1

    def __post_init__(self) -> None:
        _positive("dp", self.dp)
        _positive("tp", self.tp)
        _positive("cp", self.cp)
        _choice("--cp-attention", self.cp_attention, CP_ATTENTIONS)
        if self.cp > 1:
            _check_cp(self)
        _positive("ep", self.ep)
        if self.ep > 1 and self.dp % self.ep:
            raise ConfigError(
                f"--ep {self.ep} does not divide the {self.dp} data-parallel ranks of each stage (dp={self.dp}): "
                "expert parallelism borrows a stage's data-parallel ranks",
                hint=f"pass --dp {self.ep * max(1, self.dp // self.ep)} with --ep {self.ep}, or --ep among the "
                     f"divisors of {self.dp}",
            )
        if self.ep > 1 and self.dp_mode == "hsdp":
            raise ConfigError(f"--ep {self.ep} with --dp-mode hsdp: expert parallelism is built on DDP and FSDP2 "
                              "data parallelism only", hint="pass --dp-mode ddp or fsdp with --ep")
        if self.pipeline.moe_overlap and self.ep == 1:
            raise ConfigError("--moe-overlap on hides the experts' all-to-all behind computation, but with ep=1 "
                              "there is none", hint="pass --ep 2 or more (with --dp), or --moe-overlap off")
        if self.ep > 1 and self.cp > 1:
            raise ConfigError(f"--ep {self.ep} with --cp {self.cp}: expert parallelism borrows data-parallel ranks "
                              "and is not built beside context parallelism yet", hint="pass --cp 1 with --ep")
        _choice("dp mode", self.dp_mode, DP_MODES)
        self._check_sharding()
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("--sequence-parallel splits the sequence over the tensor-parallel ranks, but tp=1",
                              hint="pass --tp 2 or more with --sequence-parallel, or drop --sequence-parallel")
        if self.loss_parallel and self.tp == 1:
            raise ConfigError("--loss-parallel splits the head over the tensor-parallel ranks, but tp=1",
                              hint="pass --tp 2 or more with --loss-parallel, or drop --loss-parallel")
        if self.tp > 1 and self.dp * self.cp > 1 and self.dp_mode == "ddp":  # hsdp is FSDP2 too
            # FSDP2 over dp composes with TP's DTensor parameters (torchtitan's way, parity-tested here); DDP is not
            # (cp ranks hold the same parameters and reduce their gradients as data ranks do)
            over = f"dp={self.dp}" if self.cp == 1 else f"dp={self.dp} x cp={self.cp} (gradients reduced over both)"
            raise ConfigError(
                f"tp={self.tp} with {over} needs --dp-mode fsdp: pipetrain composes tensor parallelism with "
                "FSDP2 (parity-tested), not with DDP",
                hint="pass --dp-mode fsdp",
            )
        if self.tp > 1 and self.pipeline.compile:
            raise ConfigError(f"--compile with tp={self.tp}: compiled blocks are not tested on tensor-parallel "
                              "(DTensor) weights in pipetrain", hint="drop --compile, or use --tp 1")
        if self.dp * self.cp > 1 and self.dp_mode == "ddp" and self.pipeline.schedule in SPLIT_BACKWARD_SCHEDULES:
            # measured on torch 2.13 (parity against one process): zero-bubble's and zbv's backward split into
            # input and weight parts gives DDP wrong gradients; dualpipev's overlapped forward/backward trips
            # DDP's reducer ("gradient which is undefined, but still allreduced by DDP reducer"). The cp ranks
            # reduce their gradients as data ranks do (DDP over dp x cp): the same holds with cp > 1.
            over = f"dp={self.dp}" if self.cp == 1 else f"dp={self.dp} x cp={self.cp}, gradients reduced over both"
            raise ConfigError(
                f"schedule {self.pipeline.schedule!r} splits each backward in two, which DDP does not follow in "
                f"torch 2.13: its gradients would be wrong ({over}, --dp-mode ddp)",
                hint="pass --dp-mode fsdp, which trains it exactly, or another schedule",
            )

    def _check_sharding(self) -> None:
        """Refuse `--dp-shard` and `--fsdp-reshard` values the data-parallel mode cannot use."""
        if self.dp_mode == "hsdp":
            if self.dp_shard is None or self.dp_shard < 1 or self.dp % self.dp_shard:
                raise ConfigError(f"--dp-mode hsdp needs --dp-shard K dividing dp={self.dp}, got {self.dp_shard}",
                                  hint=f"pass --dp-shard among the divisors of {self.dp} (the ranks of one node)")
        elif self.dp_shard is not None:
            raise ConfigError(f"--dp-shard {self.dp_shard} with --dp-mode {self.dp_mode}: only hsdp has shard groups",
                              hint="pass --dp-mode hsdp, or drop --dp-shard")
        reshard = self.fsdp_reshard
        if isinstance(reshard, bool) or not (reshard in FSDP_RESHARD or isinstance(reshard, int)):
            raise ConfigError(f"unknown --fsdp-reshard {reshard!r}",
                              hint="choose never, always, auto or a group size N >= 2")
        if reshard != "never" and self.dp_mode not in SHARDED_DP_MODES:
            raise ConfigError(f"--fsdp-reshard {reshard} with --dp-mode {self.dp_mode}: only FSDP2 shards weights",
                              hint="pass --dp-mode fsdp (or hsdp), or drop --fsdp-reshard")
        if reshard not in ("never", "auto") and self.pipeline.schedule in SPLIT_BACKWARD_SCHEDULES:
            # measured on torch 2.13 (gloo, dp 2 x pp 2): resharded weights leave zero-bubble's weight half without
            # some gradients (None after the step); FSDP2 also reduces a block when its input gradient is ready
            raise ConfigError(f"--fsdp-reshard {reshard} with schedule {self.pipeline.schedule!r}: its backward is "
                              "split in two, and FSDP2 would reshard (and reduce) between the halves",
                              hint="pass --fsdp-reshard never with this schedule, or use 1f1b / interleaved-1f1b")
        if isinstance(reshard, int):
            shard = self.dp_shard if self.dp_mode == "hsdp" else self.dp
            if reshard < 2 or reshard >= shard or shard % reshard:
                raise ConfigError(f"--fsdp-reshard {reshard}: a group size must divide the {shard} ranks a "
                                  "parameter is sharded over, between 2 and one less than that",
                                  hint="pass a proper divisor of the shard group, or always")
            if self.pipeline.pp > 1:
                # FSDP2 makes a device mesh (a collective new_group of every rank) for each module given an int;
                # pipeline ranks wrap different stages, a different number of modules: the ranks would hang
                raise ConfigError(f"--fsdp-reshard {reshard} with pp={self.pipeline.pp}: FSDP2 builds a process "
                                  "group per module for a group size, which pipeline ranks cannot do in step",
                                  hint="pass --fsdp-reshard always (or never) inside a pipeline")

    @property
    def pp(self) -> int:
        return self.pipeline.pp

    @property
    def dp_text(self) -> str:
        """The data-parallel mode in words: "ddp", "fsdp, reshard always", "hsdp 2 x 4" (replicas x shard ranks)."""
        mode = (f"hsdp {self.dp // (self.dp_shard or self.dp)} x {self.dp_shard}" if self.dp_mode == "hsdp"
                else self.dp_mode)
        return mode + (f", reshard {self.fsdp_reshard}" if self.fsdp_reshard != "never" else "")

    @property
    def dp_replicas(self) -> int:
        """Replica groups of the data-parallel axis: dp / dp_shard under hsdp, else dp (ddp) or 1 (fsdp)."""
        if self.dp_mode == "hsdp":
            return self.dp // (self.dp_shard or self.dp)
        return self.dp if self.dp_mode == "ddp" else 1

    @property
    def world_size(self) -> int:
        return self.dp * self.pipeline.pp * self.cp * self.tp

    @property
    def mesh_text(self) -> str:
        """"P", or "P x tp=T" with tensor parallelism, "... x cp=C (ring)" with context parallelism, then ", experts
        over ep=E" with expert parallelism (what banners print after "pp=")."""
        return f"{self.pp}" + (f" x tp={self.tp}" + (" (sequence-parallel)" if self.sequence_parallel else "")
                               if self.tp > 1 else "") + (f" x cp={self.cp} ({self.cp_attention})" if self.cp > 1 else "") + (
                                   f", experts over ep={self.ep}" if self.ep > 1 else "")

    def check_world(self, world_size: int) -> None:
        """Raise if the job has a different number of ranks than the mesh uses."""
        if world_size != self.world_size and self.cp > 1:
            raise ConfigError(
                f"dp={self.dp} x pp={self.pp} x cp={self.cp} x tp={self.tp} = {self.world_size} ranks, but the job "
                f"has {world_size}", hint=f"launch {self.world_size} ranks, or choose dp * pp * cp * tp = {world_size}")
        if world_size != self.world_size:
            if self.tp == 1:
                raise ConfigError(
                    f"dp={self.dp} x pp={self.pp} = {self.world_size} ranks, but the job has {world_size}",
                    hint=f"launch {self.world_size} ranks, or choose dp and pp with dp * pp = {world_size}",
                )
            raise ConfigError(
                f"dp={self.dp} x pp={self.pp} x tp={self.tp} = {self.world_size} ranks, but the job has {world_size}",
                hint=f"launch {self.world_size} ranks, or choose dp, pp and tp with dp * pp * tp = {world_size}",
            )

    def check_nodes(self, ranks_per_node: int) -> None:
        """Raise if a tensor-parallel group would span two nodes (tp innermost: it needs tp | ranks per node)."""
        if self.tp > 1 and ranks_per_node % self.tp:
            raise ConfigError(
                f"tp={self.tp} does not divide the {ranks_per_node} ranks per node: a tensor-parallel group would "
                "span two nodes, and its all-reduces of every layer's activations would cross the network",
                hint=f"pass --tp among the divisors of {ranks_per_node}, or more ranks per node",
            )

    def check_global_batch(self, batch_size: int) -> None:
        """Raise if the global batch does not split evenly over the replicas."""
        if batch_size % self.dp:
            raise ConfigError(
                f"global batch size {batch_size} is not divisible by dp={self.dp}",
                hint=f"pass --batch-size {self.dp * max(1, batch_size // self.dp)}",
            )
        self.pipeline.check_batch(batch_size // self.dp)


def _check_cp(parallel: ParallelConfig) -> None:
    """Raise for what context parallelism (cp > 1) does not compose with."""
    if parallel.sequence_parallel or parallel.loss_parallel:
        flag = "--sequence-parallel" if parallel.sequence_parallel else "--loss-parallel"
        raise ConfigError(f"cp={parallel.cp} with tp={parallel.tp} and {flag}: tp composes with cp by heads only (each "
                          "tp rank runs the ring or all-to-all over its own heads), and sequence parallelism would cut "
                          "the cut sequence again, loss parallelism the per-token loss of the cut targets",
                          hint=f"drop {flag} with --cp")
    if parallel.dp_mode == "hsdp" or parallel.fsdp_reshard not in ("never", "always"):
        raise ConfigError(f"cp={parallel.cp} with --dp-mode {parallel.dp_mode}, --fsdp-reshard "
                          f"{parallel.fsdp_reshard}: the data-parallel groups span the context ranks, and pipetrain "
                          "does not split them into HSDP or reshard groups yet",
                          hint="use --dp-mode ddp or fsdp with --fsdp-reshard never or always with --cp")
    if parallel.pipeline.compile:
        raise ConfigError(f"--compile with cp={parallel.cp}: the ring's and all-to-all's exchanges inside each "
                          "attention would break every compiled block's graph", hint="drop --compile, or use --cp 1")

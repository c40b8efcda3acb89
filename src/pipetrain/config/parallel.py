"""`ParallelConfig`: the device mesh (dp, pp, tp, cp, ep) around a `PipelineConfig`, and what composes with what,
validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from pipetrain.config.choices import (CP_ATTENTIONS, DP_MODES, FSDP_RESHARD, SHARDED_DP_MODES,
                                      SPLIT_BACKWARD_SCHEDULES, _choice, _positive)
from pipetrain.config.pipeline import PipelineConfig
from pipetrain.errors import ConfigError

__all__ = ["ParallelConfig"]


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """The device mesh: `dp` replicas (or shards) of a `pp`-rank pipeline whose every stage is split over `tp`
    ranks (tensor parallelism, innermost: the ranks of a TP group are neighbours); world size = dp * pp * tp.

    `sequence_parallel` (needs tp > 1) also splits the norm and dropout regions along the sequence;
    `loss_parallel` (needs tp > 1) splits a language model's head over the vocabulary, with the cross-entropy
    computed on the shards (`torch.distributed.tensor.parallel.loss_parallel`).
    `ep` (expert parallelism, docs/moe-ep.md) splits each MoE layer's experts over `ep` of a stage's `dp` ranks
    (it borrows them: the world size stays dp * pp * tp); `ep` divides dp (under hsdp, `dp_shard`: the experts'
    FSDP2 then shards over dp_shard / ep ranks and replicates across the shard groups, as torchtitan's "efsdp").
    Beside cp (pp 1, tp 1 only) the expert-parallel group is the ep ranks with the same cp coordinate.
    `cp` (context parallelism, docs/long-context.md) cuts each sequence over `cp` ranks of every stage, attention
    by `cp_attention` ("ring" or "ulysses"); world size = dp * pp * cp * tp. Beside tp, `sequence_parallel` cuts a
    rank's part again over the tp ranks between the TP regions (1 / (cp * tp) of each sequence), `loss_parallel`
    splits the logits of the rank's part over the vocabulary.
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
        if self.ep > 1 and self.dp_mode == "hsdp" and self.dp_shard and self.dp_shard % self.ep:
            raise ConfigError(f"--ep {self.ep} with --dp-mode hsdp --dp-shard {self.dp_shard}: expert parallelism "
                              "borrows ranks of one shard group, and ep does not divide it",
                              hint=f"pass --ep among the divisors of {self.dp_shard}, or a --dp-shard ep divides")
        if self.pipeline.moe_overlap and self.ep == 1:
            raise ConfigError("--moe-overlap on hides the experts' all-to-all behind computation, but with ep=1 "
                              "there is none", hint="pass --ep 2 or more (with --dp), or --moe-overlap off")
        if self.ep > 1 and self.cp > 1 and (self.pipeline.pp > 1 or self.tp > 1):
            # each composes with ep or cp alone; the three together need 8 ranks and are not parity-tested yet
            beside = f"pp={self.pipeline.pp}" if self.pipeline.pp > 1 else f"tp={self.tp}"
            raise ConfigError(f"--ep {self.ep} with --cp {self.cp} and {beside}: expert parallelism beside context "
                              "parallelism is built at pp 1 and tp 1 only (parity-tested at dp2 x ep2 x cp2)",
                              hint="pass --pp 1 --tp 1 with --ep and --cp, or --cp 1 (or --ep 1) with --pp/--tp")
        if self.ep > 1 and self.cp > 1 and self.dp_mode == "hsdp":
            raise ConfigError(f"--ep {self.ep} with --cp {self.cp} and --dp-mode hsdp: expert parallelism is built "
                              "beside context parallelism or under HSDP, not both at once",
                              hint="pass --dp-mode fsdp (or ddp) with --ep and --cp, or --cp 1 under hsdp")
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
    if parallel.fsdp_reshard not in ("never", "always"):
        raise ConfigError(f"cp={parallel.cp} with --fsdp-reshard {parallel.fsdp_reshard}: the data-parallel groups "
                          "span the context ranks, and pipetrain does not split them into reshard groups yet",
                          hint="use --fsdp-reshard never or always with --cp")
    if parallel.pipeline.compile:
        raise ConfigError(f"--compile with cp={parallel.cp}: the ring's and all-to-all's exchanges inside each "
                          "attention would break every compiled block's graph", hint="drop --compile, or use --cp 1")

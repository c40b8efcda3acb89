"""`PipelineConfig`: one pipeline's stages, schedule, micro-batches, recomputation and balance, validated on
construction."""

from __future__ import annotations

from dataclasses import dataclass

from pipetrain.config.choices import (CHECKPOINT_POLICIES, PARTITION_METHODS, RECOMPUTE_UNITS, SCHEDULES,
                                      SELECTIVE_MATMULS, SPLIT_BACKWARD_SCHEDULES, V_SCHEDULES, _choice, _positive,
                                      schedule_is_multi_stage)
from pipetrain.errors import ConfigError

__all__ = ["PipelineConfig"]


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
    #: with unit "selective": which matrix products each recomputed block keeps (`--selective-matmuls`): "all", or
    #: "alternate" (the 1st, 3rd, ... of the block's forward; the others run again: torchtitan's op-level policy)
    selective_matmuls: str = "all"
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
        _choice("--selective-matmuls", self.selective_matmuls, SELECTIVE_MATMULS)
        if self.selective_matmuls != "all" and self.recompute_unit != "selective":
            raise ConfigError(f"--selective-matmuls {self.selective_matmuls} picks the matrix products selective "
                              f"recomputation keeps, but the recomputation unit is {self.recompute_unit!r}",
                              hint="add --checkpoint selective (or --recompute-unit selective)")
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
            f" ({self.recompute_unit}" + (f" every {self.recompute_every}" if self.recompute_every > 1 else "")
            + (f", {self.selective_matmuls} matrix products" if self.selective_matmuls != "all" else "") + ")")
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

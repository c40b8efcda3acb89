"""One way to run the job, as the planner prices it: parallel sizes, schedule, precision and memory modes."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipetrain.plan.context import context_replicas

__all__ = ["Layout"]


@dataclass(frozen=True, kw_only=True)
class Layout:
    """One way to run the job. `balance` "uniform" (equal block counts) or "time" (solver on block times);
    `tp` tensor-parallel ranks per pipeline rank (innermost: a TP group's ranks are consecutive, on one node)."""

    dp: int
    pp: int
    batch: int
    chunks: int
    schedule: str = "1f1b"
    virtual: int = 1
    checkpoint: str = "never"
    dp_mode: str = "ddp"
    balance: str = "uniform"
    gpus_per_node: int = 0  # 0: every rank on one node
    tp: int = 1
    sequence_parallel: bool = False
    #: "fp32" (weights, gradients and AdamW state in the blocks' parameter bytes) or "bf16" (pipetrain's autocast:
    #: fp32 weights and state; FSDP gathers the weights in bf16 and accumulates gradients in fp32)
    precision: str = "fp32"
    #: what-if: Float8 projections whose FSDP all-gather is in float8 (gathered at 1 byte; torchtitan's
    #: `enable_fsdp_float8_all_gather`); pipetrain's engine has no Float8
    float8: bool = False
    #: what recomputation checkpoints: "stage" (the whole stage, keeping its input), "layer" (each block alone,
    #: keeping every block's input: torchtitan's and Megatron's full recomputation) or "selective" (each block
    #: keeping its matrix products' and attention's outputs, `BlockCost.selective_bytes`)
    recompute_unit: str = "stage"
    #: expert parallelism: each MoE block's routed experts divided over `ep` ranks of its stage's dp group
    ep: int = 1
    #: the busiest expert's tokens over the mean (1.0: a perfectly balanced router; matters at ep > 1)
    moe_imbalance: float = 1.0
    #: `--moe-overlap on`: DualPipeV's fused pairs hide the experts' all-to-alls behind compute (plan/overlap.py)
    moe_overlap: bool = False
    #: context parallelism: each sequence split over `cp` ranks of a stage (pp · tp apart, as train's mesh), and
    #: their attention
    cp: int = 1
    cp_attention: str = "ring"
    #: with unit "layer" or "selective": only every K-th block recomputes (the others keep all their activations)
    recompute_every: int = 1
    #: with unit "selective": the matrix products each block keeps, "all" or "alternate" (every other one:
    #: `BlockCost.alternate_bytes`, its recomputed products `alternate_flops`)
    selective_matmuls: str = "all"
    #: FSDP only: weights resharded after each block's forward (gathered again for its backward) and gradients
    #: reduce-scattered per micro-batch, accumulated sharded (`--fsdp-reshard always`; see plan/reshard.py)
    fsdp_reshard: bool = False
    #: activations of micro-batches waiting for their backward held in host memory (`--offload-activations`)
    offload: bool = False
    #: with dp_mode "hsdp": data replicas of one shard group (FSDP within, replicas across: `--dp-shard`); with cp
    #: a shard group is those replicas with their cp ranks (dp_shard · cp ranks hold a parameter's shards)
    dp_shard: int = 0
    #: what-if: the last stage's outputs kept by torch's schedule to the step's end and merged there (torchtitan's
    #: loop); pipetrain's engine drops each micro-batch's once its loss and metrics are computed (plan/loss.py)
    keep_outputs: bool = False

    @property
    def shards(self) -> int:
        """Ranks a parameter is sharded over: dp under FSDP, the shard group under HSDP, else 1 (of one cp rank's
        replicas: `gradient_layout` counts the cp ranks in)."""
        if self.dp_mode == "hsdp":
            return self.dp_shard or self.dp
        return self.dp if self.dp_mode == "fsdp" else 1

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp * self.cp

    def gradient_layout(self) -> Layout:
        """The layout whose dp is every rank a stage's gradients are reduced over (its replicas and its CP ranks);
        under HSDP its shard groups hold their replicas' CP ranks too (dp_shard · cp ranks, as train's mesh)."""
        if self.cp == 1:
            return self
        shard = self.dp_shard * self.cp if self.dp_mode == "hsdp" and self.dp_shard else self.dp_shard
        return replace(self, dp=context_replicas(self), cp=1, dp_shard=shard)

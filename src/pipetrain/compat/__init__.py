"""torch's private names, in one room: every use of one in pipetrain lives in a module here, and `PRIVATE_NAMES`
lists them all (tests/unit/test_compat.py fails loudly, naming the one, when a torch upgrade moves any).

`pipelining`: schedule orders as data, the V placement's breadth-first schedule, timed P2P waits; `dtensor`: the
strided placement and the placement methods that run collectives; `tensor_styles`: tensor-parallel styles
built on torch's private style hooks; `grouped`: the experts' grouped matmul; `modules`: the dropout and batch-norm
base classes, `_foreach_mul_`, aborting a process group, the parameters DDP ignores; `mesh`: flattening two mesh
dimensions into one (HSDP's dp axis); `overlap`: DualPipeV's fused forward-and-backward actions run concurrently,
and whether a thread is inside a backward pass; `live`: a dispatch mode counting the bytes of live storages;
`attention_kernels`: the fused attention kernels that return the log-sum-exp, forward and backward (the ring's blocks).
"""

from __future__ import annotations

__all__ = ["PRIVATE_NAMES"]

_SCHEDULES = "torch.distributed.pipelining.schedules"
_PLACEMENTS = "torch.distributed.tensor.placement_types"
_STYLES = "torch.distributed.tensor.parallel.style"

#: (module, dotted name in it) of every private torch name pipetrain uses, with the compat module that uses it.
PRIVATE_NAMES: tuple[tuple[str, str], ...] = (
    # pipelining.py: torch's own schedule orders, lowering, the breadth-first V schedule, the P2P wait
    (_SCHEDULES, "ScheduleGPipe._get_pipeline_order"),
    (_SCHEDULES, "Schedule1F1B._get_pipeline_order"),
    (_SCHEDULES, "ScheduleInterleaved1F1B._calculate_single_rank_operations"),
    (_SCHEDULES, "ScheduleInterleavedZeroBubble._calculate_single_rank_operations"),
    (_SCHEDULES, "ScheduleInterleavedZeroBubble._add_bubbles_to_actions"),
    (_SCHEDULES, "ScheduleZBVZeroBubble._calculate_single_rank_operations"),
    (_SCHEDULES, "ScheduleDualPipeV._calculate_single_rank_operations"),
    (_SCHEDULES, "ScheduleLoopedBFS._calculate_single_rank_operations"),
    (_SCHEDULES, "_Action"),
    (_SCHEDULES, "_Action.sub_actions"),
    (_SCHEDULES, "_ComputationType"),
    (_SCHEDULES, "_add_send_recv"),
    (_SCHEDULES, "_validate_schedule"),
    (_SCHEDULES, "_add_reduce_grad"),
    (_SCHEDULES, "_wait_batch_p2p"),
    # overlap.py: the runtime's fused action, its state and per-action steps; autograd's current graph task
    (_SCHEDULES, "_PipelineScheduleRuntime.register_custom_function"),
    (_SCHEDULES, "_PipelineScheduleRuntime._assert_unsharded"),
    (_SCHEDULES, "_PipelineScheduleRuntime._maybe_compute_loss"),
    (_SCHEDULES, "_PipelineScheduleRuntime._maybe_get_loss"),
    (_SCHEDULES, "_ComputationType.OVERLAP_F_B"),
    ("torch._C", "_current_graph_task_id"),
    # dtensor.py: the strided placement and the placement methods that run collectives
    (_PLACEMENTS, "_StridedShard"),
    (_PLACEMENTS, "_MaskPartial"),
    (_PLACEMENTS, "Partial._reduce_value"),
    (_PLACEMENTS, "_MaskPartial._reduce_value"),
    (_PLACEMENTS, "Shard._reduce_shard_tensor"),
    (_PLACEMENTS, "Shard._to_replicate_tensor"),
    (_PLACEMENTS, "_StridedShard._to_replicate_tensor"),
    (_PLACEMENTS, "Shard._to_new_shard_dim"),
    # tensor_styles.py: the hooks of torch's styles that pipetrain's styles override or call
    (_STYLES, "ParallelStyle._apply"),
    (_STYLES, "ColwiseParallel._partition_linear_fn"),
    (_STYLES, "ColwiseParallel._prepare_input_fn"),
    (_STYLES, "PrepareModuleOutput._prepare_out_fn"),
    # modules.py
    ("torch.nn.modules.batchnorm", "_BatchNorm"),
    ("torch.nn.modules.dropout", "_DropoutNd"),
    ("torch", "_foreach_mul_"),
    ("torch.distributed.distributed_c10d", "_abort_process_group"),
    ("torch.distributed.distributed_c10d", "_world.pg_map"),
    ("torch.nn.parallel", "DistributedDataParallel._set_params_and_buffers_to_ignore_for_model"),
    ("torch._C._distributed_c10d", "_dump_fr_trace"),  # the flight recorder's dump (CUDA builds: _dump_nccl_trace)
    # grouped.py: the grouped matmul where torch has no public `torch.nn.functional.grouped_mm` (before 2.10)
    ("torch", "_grouped_mm"),
    # mesh.py: HSDP's dp axis, the flattened (dp_replicate, dp_shard)
    ("torch.distributed.device_mesh", "DeviceMesh._flatten"),
    # live.py: the bytes a CPU run allocates, storage by storage
    ("torch.utils._python_dispatch", "TorchDispatchMode"),
    ("torch.utils._pytree", "tree_flatten"),
    # attention_kernels.py: the fused attention kernels with their log-sum-exp, and their backwards
    ("torch", "ops.aten._scaled_dot_product_flash_attention_for_cpu"),
    ("torch", "ops.aten._scaled_dot_product_flash_attention_for_cpu_backward"),
    ("torch", "ops.aten._scaled_dot_product_efficient_attention"),
    ("torch", "ops.aten._scaled_dot_product_efficient_attention_backward"),
)

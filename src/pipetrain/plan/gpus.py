"""The published figures of the GPUs the planner knows by name (`pipetrain plan --gpu NAME`), each with its source.

Plain data: peak dense matrix rates per precision (no 2:4 sparsity), HBM size and bandwidth, the link between the
GPUs of a node (per direction) and the network card each GPU has to other nodes. `hardware.named_gpu` turns them
into the planner's `Device` and `Network` by one rule, the same for every GPU. Sources are the vendors' data sheets
(figures with sparsity halved where a sheet lists only those).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GpuFigures", "GPUS", "ALIASES"]

_GB = 1e9


@dataclass(frozen=True, kw_only=True)
class GpuFigures:
    """One GPU as its data sheet states it, and the node it usually sits in."""

    name: str
    bf16_flops: float  #: peak dense BF16 matrix FLOP/s
    tf32_flops: float  #: peak dense TF32 matrix FLOP/s (pipetrain's fp32 on CUDA; MI300X: its "TF32" matrix rate)
    fp32_flops: float  #: peak IEEE fp32 FLOP/s (`--precision fp32-strict`)
    memory_gb: float  #: HBM, in the sheet's GB (counted as GiB by the planner, as `--gpu-mem` is)
    hbm_bytes_per_s: float  #: peak HBM bandwidth
    link_bytes_per_s: float  #: GPU-to-GPU bandwidth within a node, per direction, all links together
    nic_bytes_per_s: float  #: one network card per GPU to other nodes (InfiniBand or RoCE), per direction
    kernel_overhead_s: float = 5e-6  #: assumed launch cost per kernel (not on a sheet)
    optimizer_s_per_param: float = 1e-11  #: assumed AdamW time per parameter (memory-bound: scales with HBM)
    source: str


#: name -> figures. Keep names lower-case, the form `--gpu` takes.
GPUS: dict[str, GpuFigures] = {
    # NVIDIA A100 Tensor Core GPU data sheet (2021): BF16 312, TF32 156, FP32 19.5 TFLOPS dense; 40 GB HBM2 at
    # 1,555 GB/s or 80 GB HBM2e at 2,039 GB/s; NVLink 3 600 GB/s (both directions); DGX A100: one 200 Gb/s HDR
    # InfiniBand card per GPU.
    "a100-40gb": GpuFigures(name="A100 SXM 40 GB", bf16_flops=312e12, tf32_flops=156e12, fp32_flops=19.5e12,
                            memory_gb=40, hbm_bytes_per_s=1555 * _GB, link_bytes_per_s=300 * _GB,
                            nic_bytes_per_s=25 * _GB, source="NVIDIA A100 data sheet; DGX A100 user guide"),
    "a100-80gb": GpuFigures(name="A100 SXM 80 GB", bf16_flops=312e12, tf32_flops=156e12, fp32_flops=19.5e12,
                            memory_gb=80, hbm_bytes_per_s=2039 * _GB, link_bytes_per_s=300 * _GB,
                            nic_bytes_per_s=25 * _GB, source="NVIDIA A100 data sheet; DGX A100 user guide"),
    # NVIDIA H100 data sheet (SXM5): BF16 1,979 and TF32 989 TFLOPS with sparsity (989.4 and 494.7 dense), FP32 67;
    # 80 GB HBM3 at 3.35 TB/s; NVLink 4 900 GB/s (both directions); DGX H100: one 400 Gb/s ConnectX-7 per GPU.
    "h100-sxm": GpuFigures(name="H100 SXM 80 GB", bf16_flops=989.4e12, tf32_flops=494.7e12, fp32_flops=67e12,
                           memory_gb=80, hbm_bytes_per_s=3350 * _GB, link_bytes_per_s=450 * _GB,
                           nic_bytes_per_s=50 * _GB, kernel_overhead_s=4e-6, optimizer_s_per_param=6e-12,
                           source="NVIDIA H100 data sheet; DGX H100 user guide"),
    # NVIDIA H200 data sheet (SXM): the H100's compute; 141 GB HBM3e at 4.8 TB/s; NVLink 900 GB/s; DGX H200: one
    # 400 Gb/s ConnectX-7 per GPU.
    "h200": GpuFigures(name="H200 SXM 141 GB", bf16_flops=989.4e12, tf32_flops=494.7e12, fp32_flops=67e12,
                       memory_gb=141, hbm_bytes_per_s=4800 * _GB, link_bytes_per_s=450 * _GB,
                       nic_bytes_per_s=50 * _GB, kernel_overhead_s=4e-6, optimizer_s_per_param=4.2e-12,
                       source="NVIDIA H200 data sheet; DGX H200 user guide"),
    # NVIDIA HGX B200 (8 GPUs): FP16/BF16 36 PFLOPS and TF32 18 PFLOPS with sparsity (2.25 and 1.125 PFLOPS dense per
    # GPU), FP32 600 TFLOPS (75 per GPU); 1,440 GB HBM3e at 64 TB/s (180 GB, 8 TB/s per GPU); NVLink 5 1.8 TB/s per
    # GPU (both directions); DGX B200: one 400 Gb/s ConnectX-7 per GPU.
    "b200": GpuFigures(name="B200 180 GB", bf16_flops=2250e12, tf32_flops=1125e12, fp32_flops=75e12,
                       memory_gb=180, hbm_bytes_per_s=8000 * _GB, link_bytes_per_s=900 * _GB,
                       nic_bytes_per_s=50 * _GB, kernel_overhead_s=4e-6, optimizer_s_per_param=2.5e-12,
                       source="NVIDIA HGX B200 and DGX B200 data sheets"),
    # AMD Instinct MI300X data sheet: BF16 1,307.4, TF32 653.7, FP32 (matrix) 163.4 TFLOPS dense; 192 GB HBM3 at
    # 5.3 TB/s; 7 Infinity Fabric links of 128 GB/s (both directions) to the other 7 GPUs of a platform: 448 GB/s
    # per direction; platforms pair each GPU with a 400 Gb/s NIC.
    "mi300x": GpuFigures(name="MI300X 192 GB", bf16_flops=1307.4e12, tf32_flops=653.7e12, fp32_flops=163.4e12,
                         memory_gb=192, hbm_bytes_per_s=5300 * _GB, link_bytes_per_s=448 * _GB,
                         nic_bytes_per_s=50 * _GB, optimizer_s_per_param=4e-12,
                         source="AMD Instinct MI300X data sheet"),
}

#: other spellings `--gpu` accepts, and the names of `--gpu-node` (deprecated), -> a key of GPUS
ALIASES: dict[str, str] = {"a100": "a100-80gb", "h100": "h100-sxm", "h200-sxm": "h200", "b200-sxm": "b200"}

"""Data and hybrid parallelism: the dp × pp mesh and the DDP / FSDP2 wrapping of stage modules."""

from pipetrain.parallel.mesh import Mesh, build_mesh, init_process_group, pick_device
from pipetrain.parallel.replicate import data_parallel_wrapper

__all__ = ["Mesh", "build_mesh", "init_process_group", "pick_device", "data_parallel_wrapper"]

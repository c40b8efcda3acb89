"""Private names of torch's device mesh: flattening two mesh dimensions into one (HSDP's whole dp axis)."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

__all__ = ["flatten_mesh"]


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """The 1-D mesh of every rank of `mesh` (a slice of a root mesh), registered on the root as `name` so that
    `root[name]` and its process group exist (torch 2.13 has no public flatten: `DeviceMesh._flatten`)."""
    return mesh._flatten(name)

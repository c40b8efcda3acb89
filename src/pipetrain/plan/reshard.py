"""When FSDP2 reshards a stage's weights after its forward: the `--fsdp-reshard` rule the runtime and planner share.

Resharding after forward frees a stage's gathered weights between its forward and its backward, at the price of
gathering them again for the backward: once per micro-batch. At pp 1 with few micro-batches that price is small and
the memory is the weights of the whole model (torchtitan reshards there); inside a pipeline a stage runs many
micro-batches and holds only its share of the weights, so resharding pays only when the gathered weights do not fit.
"""

from __future__ import annotations

__all__ = ["reshard_after_forward"]


def reshard_after_forward(setting: str | int, *, pp: int, split_backward: bool = False,
                          gathered_bytes: float | None = None, budget_bytes: float | None = None) -> bool | int:
    """FSDP2's `reshard_after_forward` for `setting` ("never", "always", "auto" or a group size N).

    "auto": never under the schedules that split a backward in two (`split_backward`: FSDP2 would reshard between
    the halves); else True at pp 1, and inside a pipeline True only when the weights a rank keeps gathered
    (`gathered_bytes`) would not fit in the memory left (`budget_bytes`), which the planner knows and the runtime
    does not (False).
    """
    if setting == "never":
        return False
    if setting == "always":
        return True
    if isinstance(setting, int):
        return setting
    if setting != "auto":
        raise ValueError(f"unknown fsdp_reshard {setting!r}")
    if split_backward:
        return False
    if pp == 1:
        return True
    return gathered_bytes is not None and budget_bytes is not None and gathered_bytes > budget_bytes


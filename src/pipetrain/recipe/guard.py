"""The non-finite guard: a nan/inf loss or gradient norm stops the job before its optimizer step (or is skipped)."""

from __future__ import annotations

import math
from pathlib import Path

from pipetrain.checkpoint.folders import latest_checkpoint
from pipetrain.errors import NonFiniteError

__all__ = ["NonFiniteGuard"]


class NonFiniteGuard:
    """Decides, from a step's global loss and gradient norm, whether the step may update the parameters.

    Both values are global (the same on every rank), so every rank decides alike without talking. Up to
    `skip_nonfinite` such steps are skipped over the whole run (`skipped`, saved with the checkpoints); the
    next one raises `NonFiniteError`, naming the step and, with `save_dir`, the last complete checkpoint.
    """

    def __init__(self, skip_nonfinite: int = 0, *, save_dir: Path | None = None, skipped: int = 0) -> None:
        self.skip_nonfinite = skip_nonfinite
        self.save_dir = save_dir
        self.skipped = skipped

    def check(self, step: int, loss: float, grad_norm: float) -> bool:
        """True when step `step` (0-based) is to be skipped; raise when it may neither update nor be skipped."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            return False
        if self.skipped < self.skip_nonfinite:
            self.skipped += 1
            return True
        raise NonFiniteError(self._message(step, loss, grad_norm), hint=self._hint())

    def _message(self, step: int, loss: float, grad_norm: float) -> str:
        what = f"loss {loss:g}, gradient norm {grad_norm:g}"
        skipped = f"; {self.skipped} such step(s) skipped before (--skip-nonfinite {self.skip_nonfinite})" \
            if self.skip_nonfinite else ""
        saved = ""
        if self.save_dir is not None:
            latest = latest_checkpoint(self.save_dir)
            saved = (f"; the last complete checkpoint is {str(latest)!r}" if latest is not None
                     else f"; no checkpoint in {str(self.save_dir)!r} yet")
        return f"training diverged at step {step + 1} ({what}): stopped before its optimizer step{skipped}{saved}"

    def _hint(self) -> str:
        resume = "then resume with --resume; " if self.save_dir is not None else ""
        return (f"{resume}lower --lr, add warm-up (--warmup-steps) or clipping (--grad-clip), or skip such steps "
                "with --skip-nonfinite N")

"""What `pipetrain check` found, as plain data: tolerances, per-step and per-block differences, hazards, verdict.

Pure: numbers in, lines out, no torch. Every difference is relative: for a loss `|a - b| / |ref|`; for a tensor
`||a - b|| / ||ref||` (L2 norms, the layout's value `a` against the single-process reference's `ref`), and a
block's figure is its worst tensor's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Tolerances", "TOLERANCES", "Hazard", "BlockDiff", "StepDiff", "CheckReport", "relative"]


@dataclass(frozen=True)
class Tolerances:
    """The largest relative differences a layout may show against the reference and still PASS."""

    loss: float
    grad: float
    param: float

    def line(self, precision: str) -> str:
        return (f"tolerances ({precision}): loss {self.loss:g}, gradients {self.grad:g}, parameters "
                f"{self.param:g} (relative: |a-b|/|ref| for losses, ||a-b||/||ref|| per tensor, worst tensor "
                "of each block)")


#: fp32: sums in another order (torch's own pipelining tests use rtol 1e-5; measured here up to 1.1e-6 for
#: gradients); a reference run repeats bit for bit. Parameters get the gradients' bound: a zero-initialised bias
#: is one update big after the first step, so its relative difference is its gradient's (measured up to 4.6e-6).
#: bf16: each micro-batch's gradient is rounded to bf16 once instead of the batch's, and after the first step
#: the fp32 master weights' last bits flip the bf16 rounding of some activations (see tests/distributed/
#: test_precision.py: gradients within 0.25 after step 1, final parameters within 1e-3 absolute).
TOLERANCES: dict[str, Tolerances] = {
    "fp32": Tolerances(loss=1e-5, grad=1e-4, param=1e-4),
    "bf16": Tolerances(loss=1e-2, grad=0.25, param=5e-2),
}


def relative(diff: float, ref: float) -> float:
    """`diff / |ref|`, 0 when both are 0, infinite when only the reference is 0."""
    if diff == 0.0:
        return 0.0
    return diff / abs(ref) if ref != 0.0 else float("inf")


@dataclass(frozen=True)
class Hazard:
    """Something that makes a layout differ from the reference, or would: `kind` (e.g. "batch statistics"),
    the block it was found in (None for the whole model), and what was seen. `cause`: it can explain a FAIL."""

    kind: str
    block: int | None
    detail: str
    cause: bool = False

    def line(self, labels: dict[int, str]) -> str:
        where = "" if self.block is None else f"block {self.block} ({labels.get(self.block, '?')}): "
        return f"{self.kind}: {where}{self.detail}"


@dataclass(frozen=True)
class BlockDiff:
    """One block's worst relative gradient difference of a step and parameter difference after it, with the
    tensors they were found in."""

    grad: float
    grad_tensor: str
    param: float
    param_tensor: str


@dataclass(frozen=True)
class StepDiff:
    """One optimizer step: the reference's and the layout's loss, and each block's differences."""

    ref_loss: float
    loss: float
    blocks: dict[int, BlockDiff]

    @property
    def loss_rel(self) -> float:
        return relative(abs(self.loss - self.ref_loss), self.ref_loss)


def _num(value: float) -> str:
    return f"{value:8.1e}" if value != float("inf") else "     inf"


@dataclass
class CheckReport:
    """The whole comparison: headers, steps, hazards, and the reproducibility of the reference itself."""

    header: list[str]
    precision: str
    tolerances: Tolerances
    labels: dict[int, str]
    steps: list[StepDiff]
    hazards: list[Hazard] = field(default_factory=list)
    #: the largest relative difference between two runs of the reference (loss, gradient or parameter)
    reference_spread: float = 0.0
    #: the layout's error in one line when its ranks failed before finishing the steps (then `steps` is empty)
    crashed: str | None = None

    def over(self) -> list[tuple[int, str, int, float, str]]:
        """Every figure over tolerance: (step, "loss" | "gradient" | "parameter", block or -1, value, tensor)."""
        found = []
        tol = self.tolerances
        for number, step in enumerate(self.steps, 1):
            if not step.loss_rel <= tol.loss:
                found.append((number, "loss", -1, step.loss_rel, ""))
            for block, diff in sorted(step.blocks.items()):
                if not diff.grad <= tol.grad:
                    found.append((number, "gradient", block, diff.grad, diff.grad_tensor))
                if not diff.param <= tol.param:
                    found.append((number, "parameter", block, diff.param, diff.param_tensor))
        return found

    @property
    def reproducible(self) -> bool:
        """Whether two runs of the reference agree within the gradient tolerance (else nothing can be judged)."""
        return self.reference_spread <= min(self.tolerances.loss, self.tolerances.param)

    @property
    def passed(self) -> bool:
        return self.crashed is None and self.reproducible and not self.over()

    def table(self) -> list[str]:
        n = len(self.steps)
        steps = "".join(f"{i:>9}" for i in range(1, n + 1))
        lines = [f"{'step':<22}{steps}",
                 f"{'loss (reference)':<22}" + "".join(f"{s.ref_loss:>9.5f}" for s in self.steps),
                 f"{'loss (layout)':<22}" + "".join(f"{s.loss:>9.5f}" for s in self.steps),
                 f"{'loss rel diff':<22}" + "".join(f" {_num(s.loss_rel)}" for s in self.steps), ""]
        lines.append(f"{'':<22}{'gradient rel diff, step':<{9 * n}}   {'parameter rel diff after step':<{9 * n}}")
        lines.append(f"{'block':<22}{steps}   {steps}")
        for block in sorted(self.labels):
            label = f"{block} {self.labels[block]}"[:21]
            cells = [(f" {_num(s.blocks[block].grad)}", f" {_num(s.blocks[block].param)}") if block in s.blocks
                     else (f"{'-':>9}", f"{'-':>9}") for s in self.steps]
            grads, params = "".join(c[0] for c in cells), "".join(c[1] for c in cells)
            lines.append(f"{label:<22}{grads}   {params}")
        return lines

    def verdict(self) -> list[str]:
        """The PASS or FAIL lines, naming the blocks over tolerance and the hazards that can explain them."""
        causes = [f"  likely cause: {h.line(self.labels)}" for h in self.hazards if h.cause]
        if self.crashed is not None:
            return [f"FAIL: the layout stopped with an error: {self.crashed}", *causes]
        if not self.reproducible:
            return [f"FAIL: the reference itself is not reproducible (two single-process runs differ by "
                    f"{self.reference_spread:.1e}): nothing can be compared; see the hazards above"]
        over = self.over()
        if not over:
            return [f"PASS: every loss, gradient and parameter of {len(self.steps)} step(s) within the "
                    f"{self.precision} tolerances"]
        blocks = sorted({block for _, _, block, _, _ in over if block >= 0})
        step, what, block, value, tensor = max(over, key=lambda o: o[3])
        where = f"block {block} ({self.labels.get(block, '?')}) {tensor}" if block >= 0 else "the loss"
        lines = [f"FAIL: {len(over)} figure(s) over tolerance in {len(blocks)} block(s) "
                 f"({', '.join(map(str, blocks)) or 'the loss only'}); worst: {what} of {where} at step {step}: "
                 f"{value:.1e}"]
        lines += causes
        if not causes:
            lines.append("  no hazard found that explains it: the blocks over tolerance are where to look first "
                         "(a gradient difference spreads to every earlier block)")
        return lines

    def lines(self) -> list[str]:
        out = [*self.header, self.tolerances.line(self.precision), "", *(self.table() if self.steps else []), ""]
        out.append("hazards:" if self.hazards else "hazards: none found")
        out += [f"  - {h.line(self.labels)}" for h in self.hazards]
        spread = ("identical (bit for bit)" if self.reference_spread == 0.0
                  else f"differ by {self.reference_spread:.1e} (relative)")
        out.append(f"two reference runs: {spread}")
        return out + self.verdict()

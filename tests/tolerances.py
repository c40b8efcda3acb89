"""bf16 error budgets: how far a bf16 run may be from the exact result, derived from bf16's rounding.

A bf16 run (pipelined, sharded, or the single process) is compared with the fp32 run of the single process, the
exact result for this purpose (its own rounding, 2^-24 relative, is nothing next to bf16's), tensor by tensor in
the 2-norm, and must lie within the budget below. Nothing in it was read off a machine: the same budget holds
whichever kernels did the rounding (ATEN_CPU_CAPABILITY default, avx2 or avx512, or a GPU), and two bf16 runs
of one model then agree within twice the budget.

The derivation. u = 2^-8 is bf16's unit roundoff (round to nearest, 8 significant bits counting the implicit
one, so 2^(1-8)/2).

1. One stage. A reduction of length K, y = sum_j a_j with a_j = w_j x_j, computed from bf16 operands with fp32
   accumulation (the bf16 GEMMs of the CPU and of GPUs accumulate in fp32), returns
   sum_j a_j (1 + alpha_j + beta_j) (1 + gamma) with |alpha|, |beta|, |gamma| <= u (operands and output rounded;
   the fp32 sums add K 2^-24, nothing for K <= 10^4). Taking the rounding errors as independent and of either
   sign, the probabilistic model of Higham and Mary (SIAM J. Sci. Comput. 41, 2019), under which errors grow like
   sqrt(K) u where the worst case grows like K u (far too pessimistic for these tests to catch anything), each
   error is uniform on [-u, u] (std u/sqrt(3)) and the three together have std at most
   u sqrt(sum_j a_j^2) = sqrt(K) u rms(a). With terms that do not conspire to cancel, sqrt(K) rms(a) is the size
   of y itself, so a stage adds a relative error of std u to the tensor, in the 2-norm.
2. Depth. A tensor computed through D such stages carries D independent errors; residual connections and layer
   norms pass an error on with a gain of about one, so the std grows like sqrt(D) u. A transformer layer has
   6 stages (q/k/v projection, scores, weights times values, output projection, two MLP matmuls), 2 more under
   tensor parallelism (the row-parallel partial sums rounded before their all-reduce) and 4 more under FSDP2's bf16
   parameters and inputs (the residual stream and the two norm gains in bf16); the embedding and the head add 2:
   D_f = s L + 2 for the forward, D_g = 2 D_f for a gradient (the backward goes down the same path).
3. Magnitudes. A gradient is a reduction of length K = B too: the sum of the per-sample gradients g_b of the
   batch's B samples, which may cancel (a small gradient is no more exact than a large one). Its scale is
   ||g|| + sqrt(sum_b ||g_b||^2) = ||g|| + sqrt(B) rms_b ||g_b||: errors shared by the samples (the weights'
   rounding) grow with the sum, the samples' own with sqrt(K) times their size. Outputs (logits z) scale with
   ||z||. A loss sum_r w_r CE(z_r) (rows r: samples or counted tokens, sum_r w_r = 1) moves by
   |softmax(z_r) - onehot| |dz_r| <= sqrt(2) |dz_r| per row: its scale is sqrt(2) (sum_r w_r ||z_r||^2)^(1/2).
   All scales are the fp32 run's.
4. Steps. Step s starts from weights that SGD moved by lr times the earlier gradients: they differ from the fp32
   run's by lr sum_{r<s} (g_r - g_r,fp32), known from the run's recorded gradients. Relative to each tensor (for
   a 1-D bias or norm gain, to at least sqrt(n), the unit-scale activations it shifts or scales), the largest
   such difference, rho_s, perturbs a stage's weight operand beyond its rounding: u becomes u + rho_s. The final
   parameters must lie within lr sum_s (bound on step s's gradient), plus one fp32 rounding a step, of the fp32
   run's.
5. Margin: 3 standard deviations.

Budget: ||x - x_fp32|| <= 3 (u + rho_s) sqrt(D) scale(x), D = D_f for losses and outputs, D_g for gradients.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

__all__ = ["U", "SIGMAS", "forward_stages", "budget", "bf16_ratios", "assert_bf16_parity"]

U = 2.0**-8  # bf16's unit roundoff
U32 = 2.0**-24  # fp32's
SIGMAS = 3.0


def forward_stages(layers: int, *, tp: int = 1, fsdp: bool = False) -> int:
    """D_f: the bf16 rounding stages on the forward path of a model of `layers` transformer layers (item 2)."""
    return (6 + 2 * (tp > 1) + 4 * fsdp) * layers + 2


def budget(stages: int, rho: float = 0.0) -> float:
    """Relative 2-norm error one bf16 run may have after `stages` stages, weights drifted by `rho` (items 1-5)."""
    return SIGMAS * (U + rho) * math.sqrt(stages)


def _size(name: str, exact: dict) -> float:
    """What a parameter's drift is relative to (item 4): its norm; for a 1-D one (bias, norm gain), at least the
    norm of the unit-scale activations it shifts or scales, sqrt(n)."""
    value = exact["params"][name]
    return max(value.norm().item(), value.numel() ** 0.5 if value.dim() == 1 else 0.0)


def bf16_ratios(record: dict, exact: dict, *, forward: int, lr: float,
                steps: list[dict[str, torch.Tensor]] | None = None) -> dict[str, tuple[float, str]]:
    """||record - exact|| / bound for each compared tensor of one rank's `record` (harness records), worst per kind:
    kind -> (ratio, what). Within budget: every ratio <= 1. `exact`: `reference_run(..., "fp32", terms=True)`;
    `steps`: every parameter's gradient per step in this run (default: the record's own), from which the weights'
    drift from the fp32 run (item 4) follows: SGD moved them by lr times the gradients."""
    worst: dict[str, tuple[float, str]] = {}

    def note(kind: str, what: str, actual, reference, bound: float) -> None:
        diff = torch.as_tensor(actual, dtype=torch.float64) - torch.as_tensor(reference, dtype=torch.float64)
        error = diff.norm().item()
        ratio = error / bound if bound > 0 else (math.inf if error > 0 else 0.0)
        if ratio >= worst.get(kind, (-1.0, ""))[0]:
            worst[kind] = (ratio, what)

    steps = record["grads"] if steps is None else steps
    sizes = {name: _size(name, exact) for name in exact["params"]}
    moved = {name: torch.zeros_like(value, dtype=torch.float64) for name, value in exact["params"].items()}
    allowed = dict.fromkeys(exact["params"], 0.0)  # bound on each parameter's distance to the fp32 run's
    rho = 0.0
    for step, grads in enumerate(record["grads"]):
        note("losses", f"step {step} loss", record["losses"][step], exact["losses"][step],
             budget(forward, rho) * exact["loss_scales"][step])
        tau = budget(2 * forward, rho)
        for name, ref in exact["grads"][step].items():
            bound = tau * (ref.norm().item() + exact["terms"][step][name])
            if name in grads:
                note("gradients", f"step {step} gradient of {name}", grads[name], ref, bound)
            allowed[name] += lr * bound + U32 * sizes[name]
            if name in steps[step]:
                moved[name] += lr * (steps[step][name].double() - ref.double())
        rho = max(moved[name].norm().item() / sizes[name] for name in moved)
    for name, value in record["params"].items():
        note("parameters", f"parameter {name}", value, exact["params"][name], allowed[name])
    tau = budget(forward, rho)
    for i, ((loss, outputs), (ref_loss, ref_outputs), scale) in enumerate(
            zip(record["evals"], exact["evals"], exact["eval_loss_scales"], strict=True)):
        note("evaluation", f"evaluation {i} loss", loss, ref_loss, tau * scale)
        if outputs is not None:
            note("evaluation", f"evaluation {i} outputs", outputs, ref_outputs, tau * ref_outputs.norm().item())
    return worst


def assert_bf16_parity(records: Iterable[dict], exact: dict, *, forward: int, lr: float) -> dict[str, float]:
    """Every rank's losses, gradients, parameters and evaluations within the bf16 budget of the fp32 run `exact`;
    every parameter held by some rank, outputs returned by some rank, the ranks on this process's CPU kernels.
    Returns the worst ratio (observed / bound) per kind."""
    records = list(records)
    steps = [{name: grad for record in records for name, grad in record["grads"][step].items()}
             for step in range(len(records[0]["grads"]))]  # every parameter's gradient, whichever rank holds it
    worst: dict[str, tuple[float, str]] = {}
    seen: set[str] = set()
    outputs = False
    # bf16 really ran: autocast rounds every weight gradient to bf16 (relative error about u/sqrt(3) in the 2-norm),
    # where an fp32 run agrees with the reference to about 1e-6
    away = max(((grad - exact["grads"][0][name]).norm() / exact["grads"][0][name].norm().clamp_min(1e-30)).item()
               for name, grad in steps[0].items())
    if away < U / 4:
        raise AssertionError(f"the step-0 gradients are within {away:.1e} of fp32's: bf16 autocast did not run")
    capability = torch.backends.cpu.get_cpu_capability()
    for record in records:
        if record.get("capability", capability) != capability:
            raise AssertionError(f"a rank ran {record['capability']} kernels, this process {capability}")
        for kind, value in bf16_ratios(record, exact, forward=forward, lr=lr, steps=steps).items():
            worst[kind] = max(worst.get(kind, value), value)
        seen.update(record["params"])
        outputs |= any(out is not None for _, out in record["evals"])
    over = {kind: value for kind, value in worst.items() if value[0] > 1}
    if over:
        raise AssertionError("outside the bf16 budget (observed / bound): "
                             + "; ".join(f"{what}: {ratio:.2f}" for ratio, what in over.values()))
    if not outputs:
        raise AssertionError("evaluate() returned the outputs on no rank")
    missing = set(exact["params"]) - seen
    if missing:
        raise AssertionError(f"parameters held by no rank: {sorted(missing)}")
    return {kind: ratio for kind, (ratio, _) in worst.items()}

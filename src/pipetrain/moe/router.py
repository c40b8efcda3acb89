"""The router's load-balancing loss, exact under every pipeline schedule: statistics carried with the activations.

transformers' Mixtral-style `load_balancing_loss_func` combines the router statistics of *all* layers at the model's
end: with `f_e` the fraction of top-k assignments that went to expert `e` and `P_e` the mean router probability of
`e`, both over every routed row of every MoE layer, the loss is `E * sum_e f_e * P_e` (a product of means over
layers, so not a sum of per-layer losses). No pipeline stage sees every layer, so each MoE layer block adds its
layer's per-sample sums to a tensor that crosses the stage boundaries with the hidden states
(`router_statistics`, `[batch, 2, E]`: row 0 the top-k counts, without gradient; row 1 the probability sums, with
it), and the last block turns the micro-batch's sums into its loss (`load_balancing_loss`), which `RouterAuxLoss`
adds to the token loss. Autograd then carries the gradient back into every layer's router under any schedule
(GPipe, 1F1B, interleaved, zero-bubble, ZBV, DualPipeV), and a recomputed forward recomputes the same values: no
token is counted twice.

The definition is per micro-batch (as Megatron's): a micro-batch's loss is transformers' `loss + coef * aux_loss`
of that micro-batch run alone, and the step minimises their mean weighted by the micro-batch's counted tokens, as
the token loss is (the plain mean when every micro-batch counts as many tokens).

Under context parallelism each cp rank routes its part of every sequence: the last block sums the carried
statistics over the cp group (`sum_over_ranks`, an all-reduce whose backward is the all-reduce of the gradients, as
Megatron reduces them over its cp group) before the loss, so the loss is the whole micro-batch's on every cp rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipetrain.pipeline.loss import Loss

__all__ = ["router_statistics", "load_balancing_loss", "sum_over_ranks", "RouterAuxLoss"]


def router_statistics(logits: torch.Tensor, top_k: int, batch: int) -> torch.Tensor:
    """One layer's per-sample router sums `[batch, 2, E]` from its router logits `[batch * seq, E]`, as
    `load_balancing_loss_func` counts them: softmax probabilities, the top-k experts of each row."""
    probs = F.softmax(logits.float(), dim=-1)
    chosen = torch.topk(probs, top_k, dim=-1).indices
    counts = F.one_hot(chosen, probs.shape[-1]).sum(dim=1).to(probs.dtype)  # [rows, E], no gradient
    return torch.stack((counts.view(batch, -1, counts.shape[-1]).sum(1),
                        probs.view(batch, -1, probs.shape[-1]).sum(1)), dim=1)


def load_balancing_loss(statistics: torch.Tensor, top_k: int) -> torch.Tensor:
    """transformers' `load_balancing_loss_func` of one micro-batch from its carried sums `[batch, 2, E]` (summed
    over the micro-batch's samples and MoE layers): `E * sum_e f_e * P_e`, both over every routed row."""
    batch, _, experts = statistics.shape
    # a sum over the samples as a product, whose gradient is a contiguous tensor (it crosses a stage boundary;
    # `sum`'s would be an expanded view, which the point-to-point send refuses)
    counts, probs = (statistics.new_ones(1, batch) @ statistics.reshape(batch, 2 * experts)).view(2, experts)
    rows = counts.sum() / top_k  # routed rows of every layer (each row picks top_k experts)
    return (counts / rows * probs / rows).sum() * counts.shape[0]


class _SumOverRanks(torch.autograd.Function):
    """The sum of a tensor over a group's ranks; the backward sums the gradients over them (each rank's loss
    depends on every rank's tensor)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_over_ranks(statistics: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The router statistics `[batch, 2, E]` summed over `group` (the cp ranks holding the other parts of the same
    sequences), differentiably; unchanged without a group of two or more or on the meta device (shapes only)."""
    if group is None or dist.get_world_size(group) == 1 or statistics.device.type == "meta":
        return statistics
    return _SumOverRanks.apply(statistics, group)


class RouterAuxLoss:
    """A token loss plus `coef` times the micro-batch's load-balancing loss, weighted as its counted tokens.

    The model's last block returns `(logits, aux)`, `aux[b]` the load-balancing loss of sample b's micro-batch
    (`load_balancing_loss`, broadcast over its samples). `total` adds `coef * sum_b aux[b] * count_b`
    (`count_b`: sample b's counted tokens) to the token loss's total: over one micro-batch that is its counted
    tokens times `coef * aux`, so the engine's mean over the global count is the token-weighted mean of
    transformers' per-micro-batch `loss + coef * aux_loss`, and the same sum over a step's merged outputs reports
    it exactly."""

    #: the tensors the loss reads from the last block: the logits and the auxiliary losses
    outputs = 2

    def __init__(self, base: Loss, coef: float) -> None:
        self.base, self.coef = base, coef
        self.perplexity = False  # exp(loss) would include the auxiliary term

    def total(self, output: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
        logits, aux = output
        counts = torch.stack([torch.as_tensor(self.base.count(target[b:b + 1]), device=aux.device)
                              for b in range(target.shape[0])]).to(aux.dtype)
        return self.base.total(logits, target) + self.coef * (aux * counts).sum()

    def with_base(self, base: Loss) -> RouterAuxLoss:
        """This loss around another token loss (context parallelism's, of the cut targets)."""
        return RouterAuxLoss(base, self.coef)

    def count(self, target: torch.Tensor) -> int | torch.Tensor:
        return self.base.count(target)

    def correct(self, output: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> int | torch.Tensor | None:
        return self.base.correct(output[0], target)

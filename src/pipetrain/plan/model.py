"""Per-block costs of a model for the planner: an analytic model of the reference Transformer, or a profile file.

A `BlockCost` gives, per sample of a micro-batch, the forward FLOPs and memory traffic (turned into seconds
by a `Device`), or measured seconds per sample (from a `pipetrain profile` file, rescaled linearly from
its micro-batch size, which the planner says), plus parameter, activation and output bytes.

Analytic Transformer (`nn.TransformerEncoderLayer`, hidden h, feed-forward f, sequence s, a heads),
forward matrix-multiply FLOPs per sample: QKV 6sh², scores and weighted values 4s²h, output projection
2sh², feed-forward 4shf; backward is twice the forward (Narayanan et al. 2021, eq. 3, with f = 4h:
24sh² + 4s²h per sample). Activations kept for backward per layer follow Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", section 4.1: s·b·h·(34 + 5·a·s/h)
bytes with 2-byte activations, 1-byte dropout masks and f = 4h; `transformer_activation_bytes` is the
same count for any element size, feed-forward width and dropout, and reduces to the paper's formulas:
34·s·b·h + 5·a·s²·b (none), 34·s·b·h (selective: attention core recomputed), 2·s·b·h (full: the
layer input only).

Tensor parallelism (Megatron: Narayanan et al. SC'21; Korthikanti et al. 2022, Table 2): a layer's `TensorSplit`
says what tp divides. Split: the attention's QKV and output projection weights (column- then row-parallel,
whole heads per rank), the MLP's two weights, the column-parallel biases; all matmul FLOPs; the activations
inside the TP regions (Q, K, V, the projection input, the attention core, the MLP's f-wide tensors).
Replicated: the norms, the row-parallel output biases, the embedding and the classifier head (the classifier
has no vocabulary head to split). So at tp = t the kept activations are s·b·h·(10 + 24/t + 5·a·s/(h·t)),
and with sequence parallelism (norms and dropout regions split along the sequence) s·b·h·(34 + 5·a·s/h)/t.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipetrain.errors import ConfigError

__all__ = ["BlockCost", "TensorSplit", "ExpertSplit", "ContextSplit", "transformer_activation_bytes", "transformer_blocks", "config_blocks", "profile_blocks",
           "ELEMENT_BYTES"]

#: Bytes per element of each supported dtype name.
ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True, kw_only=True)
class TensorSplit:
    """What tensor parallelism divides in one block, per sample of a micro-batch (the rest is replicated).

    `traffic` and `activation_bytes` are the parts split without sequence parallelism (with it, all of the
    block's are); `comm_bytes` is the size of the (s, h) activation each of the `collectives` per forward pass
    moves (as many again in backward: all-reduces, or all-gather + reduce-scatter pairs with sequence
    parallelism); tp must divide every size in `divides` (heads, hidden, feed-forward) and, with sequence
    parallelism, `sequence`."""

    params: int
    flops: float
    traffic: float
    activation_bytes: float
    comm_bytes: float
    collectives: int = 2
    divides: tuple[tuple[str, int], ...] = ()
    sequence: int = 0
    #: parameter tensors the split turns into DTensors (an optimizer step pays DTensor's dispatch on each)
    tensors: int = 0


@dataclass(frozen=True, kw_only=True)
class ExpertSplit:
    """The routed experts of one mixture-of-experts block, per sample of a micro-batch: what expert parallelism
    divides (`params` of `experts` experts; tensor parallelism does not split them) and what it moves (each token's
    hidden state to each of its `top_k` experts and back: `dispatch_bytes` per sample and direction). `flops` is the
    experts' share of the block's forward FLOPs at an even load (the busiest expert's excess is `predict`'s
    imbalance factor)."""

    experts: int
    top_k: int
    params: int
    flops: float
    dispatch_bytes: float
    tensors: int = 2


@dataclass(frozen=True, kw_only=True)
class ContextSplit:
    """What context parallelism exchanges in one attention block, per sequence of `sequence` tokens (plan/context.py):
    the keys and values (`kv_bytes`), the queries and the output (`qo_bytes`), the attention's score FLOPs in the
    forward (`flops`), the head counts all-to-all attention divides, and the activations' bytes per element
    (`element`: what the keys and values are sent in)."""

    sequence: int
    heads: int
    kv_heads: int
    kv_bytes: float
    qo_bytes: float
    flops: float
    element: int = 2


@dataclass(frozen=True, kw_only=True)
class BlockCost:
    """One block's costs per sample (plus `fixed_*` per micro-batch). FLOPs and bytes are for the forward;
    `kernels` counts its forward kernel launches, `tensors` its parameter tensors (the optimizer's loop)."""

    name: str
    params: int
    param_bytes: float
    activation_bytes: float
    output_bytes: float
    forward_flops: float = 0.0
    forward_traffic: float = 0.0
    kernels: int = 0
    tensors: int = 0
    fixed_backward_traffic: float = 0.0
    forward_s: float = 0.0
    backward_s: float = 0.0
    tensor: TensorSplit | None = None  # None: replicated on every tensor-parallel rank
    #: measured seconds per micro-batch whatever its size (a profile fitted over several sizes)
    fixed_forward_s: float = 0.0
    fixed_backward_s: float = 0.0
    #: parameters of the block's projection weights (what Float8 training converts; `predict`'s `float8`)
    matmul_params: int = 0
    #: parameters of `params` that train no more (a LoRA run's frozen base): no gradient, no optimizer state, no
    #: data-parallel reduction
    frozen_params: int = 0
    #: of `activation_bytes`, what selective recomputation keeps (the block's input and its matrix products' and
    #: attention's outputs); None: unknown (a profile measured without it), counted as all of them
    selective_bytes: float | None = None
    #: the same keeping every other matrix product (`--selective-matmuls alternate`), and the forward FLOPs of the
    #: products it recomputes; None: unknown, planned as `selective_bytes` (a bound from above)
    alternate_bytes: float | None = None
    alternate_flops: float = 0.0
    #: bytes per sample the block's backward holds at once beyond its saved activations (the gradients it computes
    #: before the saved tensors they free; measured by a profile, 0: unknown), as each backward starts
    backward_bytes: float = 0.0
    #: the routed experts of a mixture-of-experts layer (their parameters are part of `params`), or None
    experts: ExpertSplit | None = None
    #: the attention a context-parallel split exchanges (None: the block has no attention CP can split)
    context: ContextSplit | None = None
    #: bytes per sample the loss keeps for backward of this block's output (the model's last block; a cross-entropy
    #: over the vocabulary: its fp32 log-softmax, plan/loss.py), outside any recomputation
    loss_bytes: float = 0.0

    @property
    def trained_share(self) -> float:
        """The share of the parameters that get gradients and optimizer state (1.0 unless some are frozen)."""
        return 1.0 if not self.frozen_params or not self.params else (self.params - self.frozen_params) / self.params


def transformer_activation_bytes(s: int, b: int, h: int, a: int, *, ffn: int | None = None, element: int = 2,
                                 dropout: bool = True, recompute: str = "none", tp: int = 1,
                                 sequence_parallel: bool = False) -> float:
    """Bytes one encoder layer keeps for backward on one of `tp` ranks (Korthikanti et al. 2022, generalised;
    see module doc). recompute: "none", "selective" (the attention core s² terms are recomputed) or "full"
    (only the layer input, split along the sequence under sequence parallelism)."""
    f = 4 * h if ffn is None else ffn
    d = 1 if dropout else 0
    sbh = s * b * h
    everywhere = tp if sequence_parallel else 1  # what divides the parts outside the TP regions
    if recompute == "full":
        return float(element * sbh) / everywhere
    # outside the TP regions: QKV input (e), layer norms (2e), MLP input (e), two dropout masks;
    # inside: Q, K, V and the projection input (4e), the MLP's activation input and output (2e·f/h)
    replicated = (4 * element + 2 * d) * sbh
    split = 4 * element * sbh + 2 * element * s * b * f
    if recompute not in ("none", "selective"):
        raise ConfigError(f"unknown recomputation {recompute!r}", hint="use none, selective or full")
    if recompute == "none":  # softmax output (e), its dropout mask (1) and output (e, only with dropout)
        split += (element * (1 + d) + d) * a * s * s * b
    return float(replicated / everywhere + split / tp)


def transformer_blocks(*, vocab_size: int, seq_len: int, emsize: int, nhead: int, nhid: int, nlayers: int,
                       num_classes: int, dropout: float, dtype: str = "float32") -> list[BlockCost]:
    """The analytic costs of the reference Transformer classifier's `nlayers + 2` blocks."""
    e = ELEMENT_BYTES[dtype]
    s, h, f, a = seq_len, emsize, nhid, nhead
    d = 1 if dropout > 0 else 0
    sh = s * h
    embed_params = vocab_size * h
    blocks = [BlockCost(
        name="EmbeddingBlock", params=embed_params, param_bytes=e * embed_params,
        activation_bytes=float(d * sh + 8 * s), output_bytes=float(e * sh),
        forward_traffic=float(4 * e * sh), kernels=5, tensors=1,
        # dense embedding gradient: the whole table is zeroed and written once per micro-batch
        fixed_backward_traffic=float(2 * e * embed_params),
    )]
    layer_params = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
    layer_flops = 8 * s * h * h + 4 * s * s * h + 4 * s * h * f
    layer_traffic = e * (16 * sh + 4 * s * f + 4 * a * s * s)  # norms, residuals, softmax, dropout, activation
    layer_act = transformer_activation_bytes(s, 1, h, a, ffn=f, element=e, dropout=bool(d))
    split_act = layer_act - (4 * e + 2 * d) * sh  # all but the replicated norms, inputs and dropout masks
    split = TensorSplit(
        params=4 * h * h + 3 * h + 2 * h * f + f,  # QKV and output weights, MLP weights, column biases
        flops=float(layer_flops), traffic=float(e * (4 * s * f + 4 * a * s * s)), activation_bytes=split_act,
        comm_bytes=float(e * sh), divides=(("nhead", a), ("emsize", h), ("nhid", f)), sequence=s,
        tensors=8,  # QKV, output and the two MLP projections' weights and biases (the norms stay plain)
    )
    for index in range(nlayers):
        blocks.append(BlockCost(
            name=f"TransformerEncoderLayer{index}", params=layer_params, param_bytes=e * layer_params,
            activation_bytes=layer_act, output_bytes=float(e * sh), forward_flops=float(layer_flops),
            forward_traffic=float(layer_traffic), kernels=24, tensors=12, tensor=split,
            selective_bytes=float(e * s * (7 * h + f)),  # input, QKV, attention, projection, MLP's two products
        ))
    head_params = 2 * h + h * num_classes + num_classes
    blocks.append(BlockCost(
        name="HeadBlock", params=head_params, param_bytes=e * head_params, activation_bytes=float(2 * e * sh),
        output_bytes=float(e * num_classes), forward_flops=float(2 * h * num_classes),
        forward_traffic=float(3 * e * sh), kernels=6, tensors=4,
    ))
    return blocks


def config_blocks(config) -> list[BlockCost]:
    """`transformer_blocks` of a `pipetrain.workloads.classifier.presets.TransformerConfig` (e.g. a preset)."""
    return transformer_blocks(vocab_size=config.vocab_size, seq_len=config.seq_len, emsize=config.emsize,
                              nhead=config.nhead, nhid=config.nhid, nlayers=config.nlayers,
                              num_classes=config.num_classes, dropout=config.dropout)


def profile_blocks(profile) -> list[BlockCost]:
    """Block costs from a `pipetrain.partition.profile.ModelProfile`: times a fixed part per micro-batch plus a
    part per sample (a profile fitted over several sizes; one size: per sample only, linear), bytes per sample
    (activations and what selective recomputation keeps of them, where measured: the fitted slopes; the fixed
    parts are left out)."""
    mbs = profile.micro_batch_size
    e = ELEMENT_BYTES.get(profile.dtype, 4)
    return [BlockCost(
        name=block.name, params=block.param_bytes // e, param_bytes=float(block.param_bytes),
        activation_bytes=(block.activation_bytes - block.activation_fixed_bytes) / mbs,
        output_bytes=block.output_bytes / mbs,
        forward_s=(block.forward_s - block.forward_fixed_s) / mbs,
        backward_s=(block.backward_s - block.backward_fixed_s) / mbs,
        fixed_forward_s=block.forward_fixed_s, fixed_backward_s=block.backward_fixed_s,
        selective_bytes=(None if block.selective_bytes is None
                         else (block.selective_bytes - block.selective_fixed_bytes) / mbs),
        backward_bytes=(0.0 if block.backward_bytes is None
                        else (block.backward_bytes - block.backward_fixed_bytes) / mbs),
    ) for block in profile.blocks]

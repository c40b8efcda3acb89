"""Hugging Face causal LMs (the described families: Llama, GPT-2, Qwen2/3, Mistral, Gemma, Phi-3, OLMo-2, Granite,
Cohere 1/2, Gemma 2/3; others with the common layout) as pipetrain blocks, each rank building and loading only its own.

`HFCausalLM` reads what it needs about a model type from its `Family` description (`families/`): the blocks
(`blocks.py`: embedding, one block per decoder layer, head) are transformers' own modules, named as in the
transformers model. Batches are right-padded or unpadded; padding is ignored through the labels (`ignore_index`).
Weights come from transformers' initialisation scheme, or from a local safetensors checkpoint folder
(`config.json` + `model.safetensors` or a sharded index), from which a rank reads only its own tensors, converted
as `from_pretrained` converts them (`checkpoint.py`: per-expert files -> fused experts).
Tied input/output embeddings (GPT-2's default, SmolLM2's) stay tied (`tied_parameters`): the head holds a copy
of the embedding matrix (loaded from the same tensor) and the engine sums the two copies' gradients every
step (`pipetrain.pipeline.tied`), so they update as the one tensor of the unsplit model.
Needs the optional extra: `pip install pipetrain[hf]`."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipetrain.blocks import tp_plan_hook
from pipetrain.errors import ConfigError
from pipetrain.parallel.tensor import TPPlan
from pipetrain.workloads.hf.checkpoint import HFCheckpoint
from pipetrain.moe.capacity import check_capacity
from pipetrain.moe.router import RouterAuxLoss
from pipetrain.workloads.hf.blocks import (DecoderLayer, Embedding, Head, HFBlock, carries_router_statistics,
                                           init_like_transformers)
from pipetrain.workloads.hf.families import FAMILIES, Family, family_of, require_transformers
from pipetrain.workloads.hf.folder_checks import check_folder_config, check_weights
from pipetrain.workloads.hf.loss import CausalLMLoss, causal_lm_loss
from pipetrain.workloads.hf.proof import prove
from pipetrain.workloads.hf.tp import hf_tp_plan

__all__ = ["SUPPORTED_FAMILIES", "HFCausalLM", "CausalLMLoss", "causal_lm_loss", "require_transformers"]

#: model_type of a transformers config -> the family description pipetrain builds it by
SUPPORTED_FAMILIES: dict[str, Family] = FAMILIES


#: the old name of the checkpoint reader (tests patch its `read`)
_Checkpoint = HFCheckpoint


def _choose_kernels(config: Any) -> None:
    """Set the attention and experts implementations transformers chooses when it builds the whole model (read
    from the model built on the meta device: "sdpa" where the class supports it, else "eager"; its experts'
    "grouped_mm" or "eager"), unless the config names them."""
    if config._attn_implementation is not None and getattr(config, "_experts_implementation", "") is not None:
        return
    transformers = require_transformers()
    logging_ = transformers.utils.logging
    verbosity = logging_.get_verbosity()
    logging_.set_verbosity_error()
    try:
        with torch.device("meta"):
            built = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config)).config
    finally:
        logging_.set_verbosity(verbosity)
    if config._attn_implementation is None:
        config._attn_implementation = built._attn_implementation
    if getattr(config, "_experts_implementation", "") is None:
        config._experts_implementation = built._experts_implementation


class HFCausalLM:
    """A transformers causal LM as a `BlockModel`: embedding, `num_hidden_layers` decoder layers, head.
    Context parallelism (`--cp`) runs: the first block takes `(ids, positions)`, the decoder layers `use_context`.

    `config` is a transformers config (e.g. `LlamaConfig(...)`, `GPT2Config(...)`), `checkpoint` a local
    folder holding that model's safetensors weights (nothing is downloaded), `seq_len` the token length of
    every sample (pipeline stages need static shapes); `documents`: the input is `(token ids, positions)` of packed
    documents (`pipetrain.data.packing`), attention masked by document. Attention runs as `config._attn_implementation`
    says and a MoE layer's experts as `config._experts_implementation` says; when unset, as transformers chooses them
    building the whole model ("sdpa", or "eager" for a class that cannot use sdpa: Gemma 2, GPT-OSS; "grouped_mm").
    Use `causal_lm_loss` (`loss()`) as the engine's loss, with the input ids (padding set to -100) as targets.
    `from_folder` reads the config from the folder too, and proves the blocks against transformers' class on a tiny
    copy of it.
    """

    #: the sequence may be cut over context-parallel ranks (`pipetrain.context`)
    context_parallel = True

    def __init__(self, config: Any, *, checkpoint: str | Path | None = None, seq_len: int = 64,
                 documents: bool = False) -> None:
        family = family_of(config)
        if not 1 <= seq_len <= config.max_position_embeddings:
            raise ConfigError(f"seq_len {seq_len} is outside 1..{config.max_position_embeddings} for this model",
                              hint=f"pass seq_len <= max_position_embeddings ({config.max_position_embeddings})")
        config = copy.deepcopy(config)
        _choose_kernels(config)  # what transformers picks when it builds the whole model
        self.config, self.family, self.seq_len, self.documents = config, family, seq_len, documents
        #: the expert capacity factor of the MoE layers (`with_capacity`; None: no token dropped)
        self.capacity: float | None = None
        self.checkpoint = None if checkpoint is None else HFCheckpoint(Path(checkpoint), config)
        self._experts_kept: tuple[int, int] | None = None  # (rank, ep): `keep_experts`
        if self.checkpoint is not None:
            check_folder_config(self.config, Path(checkpoint))
            check_weights(self)

    @classmethod
    def from_folder(cls, folder: str | Path, *, seq_len: int = 64, documents: bool = False) -> HFCausalLM:
        """The model of a local folder written by `save_pretrained`: its config.json and its weights, its blocks
        proven to compute what transformers' class computes on a tiny copy of the config (`proof.prove`, once per
        job; a ConfigError naming the largest logit difference when they do not)."""
        path = Path(folder)
        if not (path / "config.json").is_file():
            raise ConfigError(f"{str(path)!r} has no config.json", hint="pass a folder written by save_pretrained")
        config = require_transformers().AutoConfig.from_pretrained(path, local_files_only=True)
        model = cls(config, checkpoint=path, seq_len=seq_len, documents=documents)
        prove(config)
        return model

    # ---- BlockModel ----------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.config.num_hidden_layers + 2

    def build_block(self, index: int) -> nn.Module:
        if not 0 <= index < self.num_blocks:
            raise IndexError(f"block {index} of {self.num_blocks}")
        if index == 0:
            block: HFBlock = Embedding(self.config, self.family)
        elif index == self.num_blocks - 1:
            block = Head(self.config, self.family)
        else:
            block = DecoderLayer(self.config, self.family, index - 1, capacity=self.capacity)
        if next(block.parameters()).device.type == "meta":
            return block  # shape inference
        if self.checkpoint is None:
            init_like_transformers(block, self.config, self.family)
        else:
            self._load(block)
        return block

    def example_input(self, batch_size: int) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Token ids `[batch, seq_len]`; with `documents` (packed documents), also their positions (same shape)."""
        ids = torch.zeros(batch_size, self.seq_len, dtype=torch.long)
        return (ids, torch.arange(self.seq_len).expand(batch_size, -1).contiguous()) if self.documents else ids

    def loss(self, base: Any = None) -> Any:
        """The loss to train this model with: `base` (`causal_lm_loss` by default), plus the load-balancing loss per
        micro-batch when the model carries it (`RouterAuxLoss`: a MoE family with `output_router_logits`)."""
        base = causal_lm_loss if base is None else base
        if not carries_router_statistics(self.config, self.family):
            return base
        return RouterAuxLoss(base, self.config.router_aux_loss_coef)

    def with_capacity(self, factor: float | None) -> HFCausalLM:
        """This model with each MoE layer's expert capacity `factor` (`pipetrain.moe.capacity`; None: none): a
        ConfigError for a bad factor or a dense model."""
        check_capacity(factor)
        if factor is not None and not self.routed:
            raise ConfigError(f"--moe-capacity {factor} caps the tokens each expert takes, but the model "
                              f"({self.config.model_type}) has no experts",
                              hint="drop --moe-capacity for a dense model")
        model = copy.copy(self)
        model.capacity = factor
        return model

    @property
    def routed(self) -> bool:
        """Whether the model is a mixture of experts (its family names experts): docs/moe.md."""
        return self.family.experts is not None

    @property
    def tied(self) -> bool:
        """Whether the output head is the input embedding matrix (`config.tie_word_embeddings`)."""
        return self.family.ties(self.config)

    def tied_parameters(self) -> list[tuple[tuple[int, str], ...]]:
        """The `BlockModel` tie hook: the embedding (block 0) and the head's matrix, when the config ties them."""
        if not self.tied:
            return []
        embedding = self.family.embed.rpartition(".")[2] + ".weight"  # the embedding block's name for it
        return [((0, embedding), (self.num_blocks - 1, "lm_head.weight"))]

    def lora_targets(self) -> tuple[str, ...]:
        """The attention and MLP projections' leaf names, LoRA's default targets (the family description's)."""
        return self.family.lora_targets

    @tp_plan_hook(loss_parallel=True)
    def tp_plan(self, index: int, tp: int, *, sequence_parallel: bool = False, loss_parallel: bool = False) -> TPPlan:
        """Block `index`'s tensor-parallel plan: the family's decoder-layer split; under `loss_parallel` the embedding
        and the head split over the vocabulary too, alike when tied; under `sequence_parallel` the residual stream
        on sequence shards (see `pipetrain.workloads.hf.tp`)."""
        return hf_tp_plan(self.config, self.family, index, self.num_blocks, tp, sequence_parallel=sequence_parallel,
                          loss_parallel=loss_parallel, seq_len=self.seq_len, documents=self.documents)

    def attention_shape(self) -> tuple[int, int, int]:
        """(layers, query heads, head dimension), for MFU (`pipetrain.logs.mfu`)."""
        heads = self.config.num_attention_heads
        head_dim = getattr(self.config, "head_dim", None) or self.config.hidden_size // heads
        return self.config.num_hidden_layers, heads, head_dim

    def parameter_keys(self, index: int) -> dict[str, str]:
        """Block `index`'s parameter names -> the names of the same tensors in the transformers model."""
        with torch.device("meta"):
            block = self.build_block(index)
        return dict(block.checkpoint_keys())

    # ---- loading -------------------------------------------------------------------------------------

    def keep_experts(self, rank: int, ep: int) -> None:
        """Read only experts [rank·E/ep, (rank+1)·E/ep) of each MoE layer from the folder (the slice rank `rank` of
        an expert-parallel group of `ep` keeps: `pipetrain.moe.experts.ExpertParallelExperts`); the others stay zero
        until the split drops them."""
        self._experts_kept = (rank, ep)

    def _kept_experts(self, stored: str, param: torch.Tensor) -> range | None:
        """The rows of `param` to read when it is a per-expert stored experts tensor (weights [E, ., .], biases
        [E, .]) and only some are kept."""
        kept = self._experts_kept
        if kept is None or param.dim() < 2 or not self.checkpoint.per_expert(stored):
            return None
        rank, ep = kept
        local = param.shape[0] // ep
        return range(rank * local, (rank + 1) * local) if param.shape[0] % ep == 0 else None

    def _load(self, block: HFBlock) -> None:
        if self.checkpoint is None:
            raise ValueError("no checkpoint folder to load from")
        state = block.state_dict()
        for name, key in block.checkpoint_keys():
            stored = self.checkpoint.find(key, self.family.base)
            if stored is None and key == "lm_head.weight":  # tied embeddings: the head reads the embedding matrix
                stored = self.checkpoint.find(f"{self.family.embed}.weight", self.family.base)
            if stored is None:
                raise ConfigError(
                    f"checkpoint folder {str(self.checkpoint.folder)!r} has no tensor {key!r}: it holds another model",
                    hint=f"pass the folder of this {self.family.name} model",
                )
            target, rows = state[name], self._kept_experts(stored, state[name])
            if rows is not None:  # expert parallelism: only this rank's experts are read; the others stay zero
                with torch.no_grad():
                    target.zero_()
                target = target[rows.start:rows.stop]
            tensor = self.checkpoint.tensor(stored, experts=rows)
            if tensor.shape != target.shape:
                raise ConfigError(
                    f"checkpoint folder {str(self.checkpoint.folder)!r}: tensor {stored!r} has shape "
                    f"{list(tensor.shape)}, this {self.family.name} model needs {list(target.shape)}",
                    hint="pass the folder of this model, or build the model from that folder (HFCausalLM.from_folder)",
                )
            with torch.no_grad():
                target.copy_(tensor)

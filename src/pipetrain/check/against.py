"""`pipetrain check --against transformers`: a Hugging Face folder's logits, pipetrain's blocks against transformers'.

The folder's model at full size, twice: as transformers' `AutoModelForCausalLM.from_pretrained` (fp32, the attention
implementation pipetrain runs) and as pipetrain's blocks in order, loaded from the same files; the logits of the same
batch of the check's data compared (`proof.logit_difference`). PASS when the largest difference is within fp32
round-off of the largest logit (`proof.ROUND_OFF`); the same comparison as the proof at build, which uses a tiny
random copy of the config, here on the real weights. No process group: one process, on CPU (or the GPU when there is
one).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pipetrain.errors import ConfigError
from pipetrain.workloads.hf.causal_lm import HFCausalLM, require_transformers
from pipetrain.workloads.hf.proof import ROUND_OFF, logit_difference

__all__ = ["AgainstReport", "against_transformers"]


@dataclass(frozen=True)
class AgainstReport:
    """The full-size comparison of one folder with transformers' class."""

    folder: str
    family: str
    tokens: tuple[int, int]  #: (batch, sequence length) compared
    difference: float  #: the largest |ours - transformers'| over the logits
    largest: float  #: the largest |transformers' logit|
    seconds: float

    @property
    def passed(self) -> bool:
        return self.difference <= ROUND_OFF * max(1.0, self.largest)

    def lines(self) -> list[str]:
        bound = ROUND_OFF * max(1.0, self.largest)
        return [f"pipetrain check --against transformers: {self.folder} ({self.family}), fp32, "
                f"{self.tokens[0]} x {self.tokens[1]} tokens of the check's data, {self.seconds:.1f} s",
                "reference: transformers' AutoModelForCausalLM.from_pretrained of the folder; pipetrain: its blocks "
                "in order, loaded from the same files",
                f"{'PASS' if self.passed else 'FAIL'}: largest logit difference {self.difference:.3g} (largest logit "
                f"{self.largest:.3g}; fp32 round-off bound {bound:.3g} = {ROUND_OFF:g} x largest)"]


def against_transformers(model: HFCausalLM, ids: torch.Tensor) -> AgainstReport:
    """Compare `model`'s blocks (a model built from a folder) with transformers' class loaded from that folder."""
    if model.checkpoint is None:
        raise ConfigError("--against transformers compares a model folder with transformers' class",
                          hint="pass --workload hf --model DIR")
    start = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    folder, logging = model.checkpoint.folder, require_transformers().utils.logging
    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()  # no loading bars and notes between the command's lines
    logging.disable_progress_bar()
    try:
        reference = require_transformers().AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, attn_implementation=model.config._attn_implementation,
            local_files_only=True).to(device).eval()
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()
    blocks = [model.build_block(index).to(device).eval() for index in range(model.num_blocks)]
    ids = ids.to(device)
    difference, largest = logit_difference(lambda x: reference(input_ids=x).logits, blocks, ids)
    return AgainstReport(str(folder), model.family.name, tuple(ids.shape), difference, largest,
                         time.perf_counter() - start)

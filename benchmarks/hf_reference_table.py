"""Not a speed benchmark: the parity table of docs/models.md, pipetrain's blocks against transformers' class per family.

For each described family (the eight of before, and Granite, Cohere, Cohere 2, Gemma 2, Gemma 3), its tiny random
folder (`tests.hf_folders.family_configs`: 2 layers, hidden 32, what sets the family apart switched on; saved by
transformers with its own initialisation, seed 0) built by `HFCausalLM.from_folder`, and the logits of 2 x 16 random
tokens compared with transformers' `AutoModelForCausalLM.from_pretrained` of the same folder; then the proof that
runs at build (`pipetrain.workloads.hf.proof.compare`: the config's tiny copy at unit-scale weights, logits of a few
units); then what main did with the folder (the family's description and the list of flags taken away: the generic
description, or its refusal); and what pipetrain does with the flags its class reads outside the decoder layers
(`families/outside.py`). Prints a markdown table.

    .venv/bin/python benchmarks/hf_reference_table.py
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import transformers  # noqa: E402

from pipetrain.blocks import build_sequential  # noqa: E402
from pipetrain.errors import ConfigError  # noqa: E402
from pipetrain.workloads.hf import proof  # noqa: E402
from pipetrain.workloads.hf.causal_lm import HFCausalLM  # noqa: E402
from pipetrain.workloads.hf.families import FAMILIES, generic, outside  # noqa: E402
from tests.distributed.test_hf_parity import tiny_configs  # noqa: E402
from tests.hf_folders import family_configs  # noqa: E402

VOCAB, SEQ = 96, 16


def _logits(folder: Path) -> float:
    model = HFCausalLM.from_folder(folder, seq_len=SEQ)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return (build_sequential(model, seed=0)(ids) - reference(input_ids=ids).logits).abs().max().item()


def _as_main(name: str, folder: Path) -> str:
    """What main did: no description for the five new families, no list of flags outside the layers."""
    if name in ("llama", "gpt2", "qwen2", "qwen3", "mistral", "gemma", "phi3", "olmo2"):
        return "same"
    families = {k: v for k, v in FAMILIES.items() if k != name}
    with mock.patch.dict(FAMILIES, families, clear=True), mock.patch.object(outside, "OUTSIDE", {}), \
            mock.patch.object(generic, "_BUILT", {}):
        try:
            model = HFCausalLM(transformers.AutoConfig.from_pretrained(folder), checkpoint=folder, seq_len=SEQ)
        except ConfigError as err:
            missing = err.message.rpartition("common layout: ")[2]
            return f"refused: not the common layout ({missing})"
        reference = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            ours, theirs = build_sequential(model, seed=0)(ids), reference(input_ids=ids).logits
        return f"generic: differs by {(ours - theirs).abs().max().item():.3g} (largest logit " \
               f"{theirs.abs().max().item():.3g})"


def _flags(config) -> str:
    entries = outside.outside_of(config)
    if not entries:
        return "none listed"
    return "; ".join(f"`{e.flag}` ({e.acts}): {'applied' if e.field else 'refused when set, naming it'}"
                     for e in entries)


def main() -> None:
    configs = {**tiny_configs(), **family_configs(VOCAB)}
    transformers.utils.logging.set_verbosity_error()
    logging.getLogger("pipetrain").setLevel(logging.ERROR)  # the generic description's line, for main's column
    transformers.utils.logging.disable_progress_bar()
    print("| family (`model_type`) | logits vs transformers, tiny random folder | proof at build (unit-scale "
          "weights) | main | flags read outside the layers, and what pipetrain does |")
    print("|---|---|---|---|---|")
    seconds = []
    with tempfile.TemporaryDirectory() as root:
        for name, config in configs.items():
            folder = Path(root) / name
            torch.manual_seed(0)
            transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
            difference = _logits(folder)
            loaded = transformers.AutoConfig.from_pretrained(folder)
            proof.compare(loaded)  # the first call of a family imports its modeling module: not timed
            start = time.perf_counter()
            result = proof.compare(loaded)
            seconds.append(time.perf_counter() - start)
            print(f"| {name} | {difference:.3g} | {result.difference:.3g} (largest logit {result.largest:.3g}) | "
                  f"{_as_main(name, folder)} | {_flags(config)} |")
    assert set(configs) == set(FAMILIES)
    print(f"\nthe proof of one config: median {statistics.median(seconds):.2f} s, largest {max(seconds):.2f} s "
          f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")


if __name__ == "__main__":
    main()

"""The pretrained-model flags of `pipetrain train` (`--model DIR`, `--no-pack`) and the TrainConfig fields they set."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pipetrain.errors import ConfigError

__all__ = ["add_model_arguments", "model_fields"]


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """`--model DIR` (a local Hugging Face folder, with --workload hf) and `--pack/--no-pack`."""
    group = parser.add_argument_group("pretrained model (--workload hf)")
    group.add_argument("--model", type=Path, default=None, metavar="DIR",
                       help="a local Hugging Face model folder (config.json, model.safetensors, tokenizer files) "
                            "to fine-tune; its own tokenizer reads the text (--data, default: the Gutenberg books); "
                            "--seq-len sets the window (default: 128)")
    group.add_argument("--pack", action=argparse.BooleanOptionalAction, default=True,
                       help="with --model: join the documents with EOS and cut them into windows of --seq-len tokens "
                            "(no padding, the pretraining convention; default); --no-pack: one document per row, "
                            "padded to --seq-len")


def model_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The `TrainConfig` fields of the parsed flags (`model_dir`, `pack`)."""
    model, pack = getattr(args, "model", None), getattr(args, "pack", True)
    if model is None and not pack:
        raise ConfigError("--no-pack applies to a pretrained model's text", hint="pass --workload hf --model DIR, or drop --no-pack")
    return {"model_dir": model, "pack": pack}

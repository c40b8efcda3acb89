"""The `pipetrain` command: one sub-command per module of this package, each with its line of the top-level help
(`VERB_HELP`); errors printed once."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from pipetrain.cli.config_file import apply_config_file
from pipetrain.errors import PipetrainError
from pipetrain.launch.env import detect
from pipetrain.launch.forkserver import preload_also, warm_up
from pipetrain.launch.ranks import mark_command_start
from pipetrain.workloads.hf import RANK_IMPORTS as HF_RANK_IMPORTS
from pipetrain.workloads.names import BUILTIN, is_import_spec, unknown_workload

__all__ = ["main"]

#: verb -> module under pipetrain.cli providing add_parser(subparsers) and run(args) -> int
VERBS = ("train", "check", "bench", "sbatch", "profile", "plan", "tune", "export", "data", "generate", "eval")
#: the verbs that start local ranks when no launcher (torchrun, srun) started this process
SPAWNING_VERBS = ("train", "check", "bench", "generate", "eval")
#: the verbs whose ranks always run a Hugging Face model (the others: with --workload hf)
HF_VERBS = ("generate", "eval")
#: the verbs whose --workload names a registered workload (checked before their module imports torch)
WORKLOAD_VERBS = ("train", "check", "profile")
#: the verbs whose module imports no torch and whose `check_flags(args)` refuses bad flags before `run` imports it:
#: their rank server starts after that check (a refused command starts none)
FLAG_CHECKED_VERBS = ("train",)
#: what `pipetrain --help` says above the verbs
DESCRIPTION = (
    "Train a PyTorch model over several devices with pipeline, data and tensor parallelism, on one machine or many: "
    "pipetrain starts the ranks itself, or runs under torchrun or Slurm. Plan a layout before you queue, check it "
    "against the unsplit model, measure it. Each verb has --help; bad input is one line naming the value and the "
    "fix, exit code 2."
)
#: each verb's line in `pipetrain --help`: what it does for the user (its own --help keeps its module's description)
VERB_HELP = {
    "train": "train a model over pipeline, data and tensor ranks",
    "check": "check that a layout trains like the unsplit model",
    "bench": "measure step time and memory over a grid of layouts",
    "sbatch": "write a Slurm batch script for a training job",
    "profile": "measure each block's time and memory for balancing",
    "plan": "rank layouts for your GPUs before you queue a job",
    "tune": "plan, then time the best few layouts on this machine",
    "export": "write a checkpoint as one unsplit model (or HF folder)",
    "data": "show your data as the model sees it, trained tokens marked",
    "generate": "generate text from a model split over pipeline and tensor ranks",
    "eval": "held-out loss, perplexity and answer accuracy of a model",
}


class _Verbs:
    """The sub-command action as each verb module's `add_parser` sees it: the verb's line in the top-level help is
    `VERB_HELP`'s, whatever help the module passes."""

    def __init__(self, action: argparse._SubParsersAction) -> None:
        self._action = action

    def add_parser(self, name: str, **kwargs) -> argparse.ArgumentParser:
        return self._action.add_parser(name, **{**kwargs, "help": VERB_HELP[name]})


def _verb(argv: Sequence[str]) -> str | None:
    return next((arg for arg in argv if not arg.startswith("-")), None)


def _flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The value given to `flag` on the command line (`FLAG VALUE` or `FLAG=VALUE`; the last one wins), else None."""
    value = None
    for arg, following in zip(argv, [*argv[1:], None]):
        if arg == flag:
            value = following
        elif arg.startswith(flag + "="):
            value = arg.partition("=")[2]
    return value


def _start_rank_server(argv: Sequence[str]) -> None:
    """For a verb that will start local ranks, start the server they are forked from (launch/forkserver.py) now:
    its imports of torch then run beside this process's own instead of after them."""
    if _verb(argv) not in SPAWNING_VERBS or {"-h", "--help", "--print-config"} & set(argv):
        return
    if _verb(argv) in HF_VERBS or _flag_value(argv, "--workload") == "hf":
        preload_also(*HF_RANK_IMPORTS)  # imported once by the server, not once per rank
    try:
        if detect() is None:
            warm_up()
    except PipetrainError:  # a bad variable: said once the verb reads the environment
        pass


def _check_workload(argv: Sequence[str]) -> None:
    """A misspelt --workload, said before the verb's module imports torch (seconds, a minute under load). A process
    that imported the registry may have registered more names: the verb itself checks them."""
    name = _flag_value(argv, "--workload")
    if (_verb(argv) not in WORKLOAD_VERBS or name is None or {"-h", "--help"} & set(argv) or is_import_spec(name)
            or name in BUILTIN or "pipetrain.workloads.registry" in sys.modules):
        return
    raise unknown_workload(name, BUILTIN)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The command's parser. With a verb in `argv`, only that verb's module is imported (the others import
    torch, which `pipetrain plan` does not need); without one, all of them, for the help."""
    parser = argparse.ArgumentParser(prog="pipetrain", description=DESCRIPTION)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="{" + ",".join(VERBS) + "}")
    verb = _verb(argv or [])
    for name in VERBS if verb not in VERBS else (verb,):
        module = importlib.import_module(f"pipetrain.cli.{name}")
        module.add_parser(_Verbs(sub)).set_defaults(run=module.run, check_flags=getattr(module, "check_flags", None))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    mark_command_start()  # a job's start-up counts from here when this process ran one before
    try:
        _check_workload(argv)  # before the imports of torch
        checked = _verb(argv) in FLAG_CHECKED_VERBS
        if not checked:  # the verb's module imports torch: the server's imports run beside it
            _start_rank_server(argv)
        parser = build_parser(argv)
        args = parser.parse_args(argv)
        logging.basicConfig(
            level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s", stream=sys.stderr
        )
        args = apply_config_file(parser, argv, args)  # --config FILE: its values under the flags given
        if args.check_flags is not None:  # what the flags alone get wrong, before the imports of torch
            args.check_flags(args)
        if checked:
            _start_rank_server(argv)
        return int(args.run(args) or 0)
    except PipetrainError as err:
        print(f"pipetrain: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pipetrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

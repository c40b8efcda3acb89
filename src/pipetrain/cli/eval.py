"""`pipetrain eval`: a Hugging Face causal LM's held-out loss and perplexity on --data (the split training holds
out), and for prompt/answer or chat rows the exact-match accuracy of its generated answers: one number for a
fine-tune's effect. The model runs split over dp × pp × tp ranks, as in training."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from pipetrain.checkpoint.folders import read_meta
from pipetrain.cli.device_args import add_device_argument, device_choice
from pipetrain.cli.model_args import add_pack_arguments, add_row_arguments, row_format
from pipetrain.cli.objective_args import add_objective_arguments, objective_settings
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.data.settings import SETTINGS_FILE, read_data_settings
from pipetrain.errors import ConfigError
from pipetrain.evaluate.run import EvalJob, eval_rank
from pipetrain.generate.weights import model_source
from pipetrain.launch.env import detect, free_port
from pipetrain.launch.lifeline import watch_agent
from pipetrain.launch.ranks import RankSpec
from pipetrain.launch.spawn import spawn
from pipetrain.lora import LoraSettings
from pipetrain.moe.split import check_expert_parallel
from pipetrain.objectives import DPOSettings
from pipetrain.train.config import TrainConfig, load_data
from pipetrain.workloads.hf.workload import DEFAULT_SEQ_LEN
from pipetrain.workloads.loader import portable

__all__ = ["add_parser", "run", "eval_job"]

log = logging.getLogger("pipetrain")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("eval", help=__doc__, description=__doc__ + " See docs/generate.md.")
    model = parser.add_argument_group("model (one of)")
    model.add_argument("--model", type=Path, default=None, metavar="DIR", help="a Hugging Face model folder")
    model.add_argument("--checkpoint", type=Path, default=None, metavar="CK",
                       help="a step-NNNNNNNN folder (or a --save-dir: its latest) of `pipetrain train --workload hf "
                            "--model DIR`; its window, packing and row fields are the defaults")
    data = parser.add_argument_group("data")
    data.add_argument("--data", type=Path, required=True, metavar="FILE|DIR",
                      help="text, JSON lines, Parquet or a datasets folder, as `pipetrain train --data` reads it; "
                           "its held-out split (every 10th sample) is evaluated")
    data.add_argument("--seq-len", type=int, default=None, help="tokens per sample (default: the checkpoint's, "
                                                                 "else 128 or the model's context when shorter)")
    data.add_argument("--batch-size", type=int, default=8, help="samples (and prompts) per batch (default: 8)")
    add_pack_arguments(data)
    add_row_arguments(data)
    answers = parser.add_argument_group("answers (prompt/answer and chat rows)")
    answers.add_argument("--no-answers", action="store_true", help="loss and perplexity only, no generation")
    answers.add_argument("--max-new-tokens", type=int, default=32, metavar="N",
                         help="longest generated answer (default: 32; greedy, stopped at EOS or end of turn)")
    answers.add_argument("--max-answers", type=int, default=None, metavar="N",
                         help="answer the first N held-out rows only (default: all)")
    answers.add_argument("--out", type=Path, default=None, metavar="FILE", help="also write the figures as JSON")
    add_objective_arguments(parser, default=None)  # unset: a DPO checkpoint's own objective
    layout = parser.add_argument_group("layout")
    layout.add_argument("--pp", type=int, default=1, help="pipeline stages (default: 1)")
    layout.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per stage (default: 1)")
    layout.add_argument("--dp", type=int, default=1, help="replicas, each evaluating its share (default: 1)")
    layout.add_argument("--ep", type=int, default=1,
                        help="a mixture of experts: each stage's experts split over this many of the --dp replicas "
                             "(a divisor of --dp and of the experts; docs/moe-ep.md) (default: 1)")
    add_device_argument(layout)
    return parser


def eval_job(args: argparse.Namespace) -> EvalJob:
    """The job the flags describe (a checkpoint's own window, packing and row fields unless given)."""
    source = model_source(args.model, args.checkpoint)
    saved = read_meta(source.checkpoint).config if source.checkpoint is not None else _exported(source.folder, args)
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens} is not positive", hint="pass a count such as 32")
    rows = row_format(args)
    if saved.get("row_format") and rows == type(rows)():
        rows = type(rows)(**saved["row_format"])
    pack = args.pack if args.pack != "windows" or "pack" not in saved else saved["pack"]
    dp_mode = "fsdp" if args.tp > 1 and args.dp > 1 else "ddp"
    parallel = ParallelConfig(dp=args.dp, dp_mode=dp_mode, tp=args.tp, ep=args.ep,
                              pipeline=PipelineConfig(pp=args.pp, schedule="gpipe", n_microbatches=args.pp))
    config = TrainConfig(workload="hf", preset=saved.get("preset", "cpu"), model_dir=source.folder, pack=pack,
                         row_format=rows, data=args.data, seq_len=args.seq_len or saved.get("seq_len"),
                         batch_size=args.batch_size, parallel=parallel, progress=False,
                         lora=LoraSettings(**source.lora) if source.lora is not None else None,
                         objective=_objective(args, saved))
    check_expert_parallel(config.model(), args.ep, dp_mode=dp_mode)
    return EvalJob(config, source.checkpoint, answers=not args.no_answers, max_new_tokens=args.max_new_tokens,
                   max_answers=args.max_answers, out=args.out)


def _objective(args: argparse.Namespace, saved: dict) -> DPOSettings | None:
    """The flags' objective, else the checkpoint's (a DPO checkpoint is evaluated on its pairs)."""
    given = objective_settings(args)
    if args.objective is None and "beta" in (saved.get("objective") or {}):  # (GRPO checkpoints: their answers)
        return DPOSettings(**saved["objective"])
    if given is not None and not isinstance(given, DPOSettings):
        raise ConfigError("pipetrain eval measures a GRPO model by its answers: --objective grpo does not apply",
                          hint="drop --objective grpo (eval rows with a prompt and its answer)")
    return given


def _exported(folder: Path, args: argparse.Namespace) -> dict:
    """The data settings `pipetrain export` wrote beside the model of `folder` (its run's window, packing and row
    fields: the defaults here); without them, one line says what is assumed in their place."""
    settings = read_data_settings(folder)
    if settings is not None:
        row = settings.get("row_format") or {}
        log.info("pipetrain eval: the data settings of the run that trained %s (%s): --seq-len %s, --pack %s, "
                 "--truncate %s%s; flags given here win", folder, SETTINGS_FILE, settings.get("seq_len", "default"),
                 settings.get("pack", "windows"), row.get("truncate", "drop"),
                 f", trained on --data {settings['data']}" if settings.get("data") else "")
        return settings
    given = [flag for flag, value in (("--seq-len", args.seq_len), ("--pack", args.pack != "windows" or None),
                                      ("--truncate", getattr(args, "truncate", "drop") != "drop" or None))
             if value is not None]
    if len(given) < 3:
        log.info("pipetrain eval: %s carries no data settings of a pipetrain run (%s, written by `pipetrain export "
                 "--hf`): assumed --seq-len %s, --pack %s, --truncate %s; pass the flags its training used",
                 folder, SETTINGS_FILE, args.seq_len or f"{DEFAULT_SEQ_LEN} (or the model's context when shorter)",
                 args.pack, getattr(args, "truncate", "drop"))
    return {}


def _rank_main(spec: RankSpec, job: EvalJob, data) -> None:
    eval_rank(spec, job, data)


def run(args: argparse.Namespace) -> int:
    job = eval_job(args)
    world = job.config.parallel.world_size
    env = detect()
    if env is None:
        data = load_data(job.config)
        device = device_choice(args, local_ranks=world)
        spawn(_rank_main, ranks=list(range(world)), world_size=world, args=(job, portable("hf", data)),
              master_addr="127.0.0.1", master_port=free_port(), device=device)
        return 0
    if env.world_size != world:
        raise ConfigError(f"the launcher started {env.world_size} ranks, --dp {args.dp} x --pp {args.pp} x --tp "
                          f"{args.tp} needs {world}", hint=f"start {world} ranks, or pass --dp/--pp/--tp to match")
    watch_agent(env)
    eval_rank(RankSpec(env.rank, env.local_rank, env.world_size, env.master_addr, env.master_port,
                       device_choice(args, env), env.num_nodes), job)
    return 0

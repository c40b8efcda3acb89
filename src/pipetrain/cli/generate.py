"""`pipetrain generate`: text from a Hugging Face causal LM split over pp × tp ranks (a model folder, or the
checkpoint of a fine-tune, full or LoRA), each stage keeping the key/value cache of its own layers; prints each
text on standard output and the tokens/s on standard error."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipetrain.cli.device_args import add_device_argument, device_choice
from pipetrain.errors import ConfigError
from pipetrain.generate.job import GenerateJob, generate_rank, prepare_job
from pipetrain.generate.prompts import read_prompts
from pipetrain.generate.sampling import Sampling
from pipetrain.generate.weights import model_source
from pipetrain.launch.env import detect, free_port
from pipetrain.launch.lifeline import watch_agent
from pipetrain.launch.ranks import RankSpec
from pipetrain.launch.spawn import spawn

__all__ = ["add_parser", "run", "add_sampling_arguments", "job_of"]


def add_sampling_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--max-new-tokens, --temperature, --top-p (shared with `pipetrain eval`)."""
    parser.add_argument("--max-new-tokens", type=int, default=32, metavar="N",
                        help="stop after N new tokens (or earlier, at every sequence's EOS; default: 32)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy (the default, as transformers' generate without do_sample); above 0: sample "
                             "from the softmax of logits / T")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="sample from the smallest set of tokens reaching this probability (default: 1, all)")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("generate", help=__doc__, description=__doc__ + " See docs/generate.md.")
    model = parser.add_argument_group("model (one of)")
    model.add_argument("--model", type=Path, default=None, metavar="DIR",
                       help="a Hugging Face folder (config.json, safetensors weights, tokenizer)")
    model.add_argument("--checkpoint", type=Path, default=None, metavar="CK",
                       help="a step-NNNNNNNN folder (or a --save-dir: its latest) of `pipetrain train --workload hf "
                            "--model DIR`, a full fine-tune (its weights) or a LoRA one (DIR's weights and its "
                            "adapters); the tokenizer and config of DIR")
    prompts = parser.add_argument_group("prompts (one of)")
    prompts.add_argument("--prompt", default=None, metavar="TEXT", help="one prompt")
    prompts.add_argument("--prompts", type=Path, default=None, metavar="FILE",
                         help="a text file, one prompt a line (generated as one batch, left-padded)")
    prompts.add_argument("--chat", action="store_true",
                         help="wrap each prompt as a user message in the tokenizer's chat template")
    layout = parser.add_argument_group("layout")
    layout.add_argument("--pp", type=int, default=1, help="pipeline stages (ranks), default 1")
    layout.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per stage, default 1")
    layout.add_argument("--ep", type=int, default=1,
                        help="a mixture of experts: run this many replicas of the pipeline, each stage's experts split "
                             "over them (each replica generates the same tokens; docs/moe-ep.md), default 1")
    add_device_argument(layout)
    decoding = parser.add_argument_group("decoding")
    add_sampling_arguments(decoding)
    decoding.add_argument("--seed", type=int, default=0, help="seed of the sampling draws (default: 0)")
    return parser


def job_of(args: argparse.Namespace) -> GenerateJob:
    """The job the flags describe, checked (one ConfigError for bad input)."""
    source = model_source(args.model, args.checkpoint)
    texts = read_prompts(args.prompt, args.prompts)
    if args.pp < 1 or args.tp < 1:
        raise ConfigError(f"--pp {args.pp} --tp {args.tp}: both must be at least 1", hint="pass --pp 2 or --tp 2")
    sampling = Sampling(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    job = GenerateJob(source, tuple(texts), pp=args.pp, tp=args.tp, chat=args.chat,
                      max_new_tokens=args.max_new_tokens, sampling=sampling, ep=args.ep)
    prepare_job(job)
    return job


def _rank_main(spec: RankSpec, job: GenerateJob) -> None:
    generate_rank(spec, job)


def run(args: argparse.Namespace) -> int:
    env = detect()
    if env is None:
        job = job_of(args)
        device = device_choice(args, local_ranks=job.world_size)
        if job.world_size == 1:
            generate_rank(RankSpec(0, 0, 1, "127.0.0.1", 0, device), job)
            return 0
        spawn(_rank_main, ranks=list(range(job.world_size)), world_size=job.world_size, args=(job,),
              master_addr="127.0.0.1", master_port=free_port(), device=device)
        return 0
    job = job_of(args)  # launched once per rank (torchrun, srun): every rank checks the same flags
    if env.world_size != job.world_size:
        raise ConfigError(f"the launcher started {env.world_size} ranks, --ep {job.ep} x --pp {job.pp} x --tp "
                          f"{job.tp} needs {job.world_size}",
                          hint=f"start {job.world_size} ranks, or pass --ep/--pp/--tp to match")
    device = device_choice(args, env)
    watch_agent(env)
    generate_rank(RankSpec(env.rank, env.local_rank, env.world_size, env.master_addr, env.master_port, device,
                           env.num_nodes), job)
    return 0

"""The flags `pipetrain plan` and `pipetrain tune` share: devices, model and batch, limits of the search, what-ifs."""

from __future__ import annotations

import argparse
import logging
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

from pipetrain.cli.device_args import add_device_argument
from pipetrain.config import CHECKPOINT_POLICIES, CP_ATTENTIONS, DP_MODES, FSDP_RESHARD, RECOMPUTE_UNITS
from pipetrain.plan.gpus import GPUS
from pipetrain.plan.hardware import DEFAULT_RATES, default_calibration_path, gpu_names
from pipetrain.plan.schedules import SIMULATED_SCHEDULES
from pipetrain.workloads.classifier.presets import PRESETS

__all__ = ["add_plan_arguments", "DEFAULT_MODEL_SEQ_LEN"]

#: The recomputation policies `plan` searches: the pipeline's, and selective recomputation (`--checkpoint selective`).
PLANNED_CHECKPOINTS = (*CHECKPOINT_POLICIES, "selective")
#: Tokens per sample of a --model plan without --seq-len.
DEFAULT_MODEL_SEQ_LEN = 2048


class _VocabParallel(argparse.Action):
    """`--vocab-parallel`, the old spelling of `--loss-parallel`: still works, with a warning naming it."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        warnings.warn("--vocab-parallel is deprecated: pass --loss-parallel", DeprecationWarning, stacklevel=2)
        logging.getLogger("pipetrain").warning("--vocab-parallel is deprecated: pass --loss-parallel (the same "
                                               "pricing, and train runs it)")
        namespace.loss_parallel = True


def _names(allowed: Iterable[str]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        values = tuple(v.strip() for v in text.split(",") if v.strip())
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"{text!r}: choose among {', '.join(allowed)}")
        return values
    return parse


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags `plan` and `tune` share."""
    gpus = parser.add_argument_group("devices")
    gpus.add_argument("--gpus", type=int, default=None, help="devices (ranks) in the job")
    gpus.add_argument("--nodes", type=int, default=None, help="nodes (with --gpus-per-node; instead of --gpus)")
    gpus.add_argument("--gpus-per-node", type=int, default=None, help="devices per node")
    gpus.add_argument("--gpu-mem", type=float, default=None, metavar="GB",
                      help="memory per device in GB (default: the device's; a plan for GPUs of a stated memory "
                           "does not use this machine's CPU calibration)")
    gpus.add_argument("--calibration", type=Path, default=None, metavar="FILE",
                      help=f"device/network figures (default: {default_calibration_path()}; "
                           "built-in A100-class figures when missing)")
    gpus.add_argument("--calibrate", action="store_true",
                      help="measure this machine first (2 ranks, about 30 s) and store it in the calibration file")
    gpus.add_argument("--gpu", type=str.lower, choices=gpu_names(), default=None, metavar="NAME",
                      help=f"plan on a GPU's data sheet at --precision ({', '.join(GPUS)}; pipetrain/plan/gpus.py), "
                           "not on a calibration (unless --calibration names one made on that GPU)")
    gpus.add_argument("--gpu-node", choices=("a100", "h100"), default=None,
                      help="deprecated: --gpu a100-80gb / --gpu h100-sxm")
    add_device_argument(gpus)
    model = parser.add_argument_group("model and batch")
    model.add_argument("--preset", default=None, help=f"reference Transformer size: {' | '.join(PRESETS)} (default: cpu)")
    model.add_argument("--profile", type=Path, default=None, metavar="FILE",
                       help="per-block profile from `pipetrain profile` (instead of the analytic model)")
    model.add_argument("--model", default=None, metavar="DIR|config.json",
                       help="a Hugging Face model folder or a bare config.json, priced from its sizes alone "
                            "(nothing loaded; llama, qwen2, qwen3, mistral, gemma, phi3, olmo2, gpt2)")
    model.add_argument("--seq-len", type=int, default=None,
                       help=f"tokens per sample with --model (default: {DEFAULT_MODEL_SEQ_LEN}, at most the "
                            "config's max_position_embeddings)")
    model.add_argument("--batch", type=int, default=256, help="global batch size (default: 256)")
    model.add_argument("--precision", choices=tuple(DEFAULT_RATES), default="fp32",
                       help="the training precision the device's rates are those of: fp32 (TF32 matmuls on CUDA), "
                            "fp32-strict, bf16 (default: fp32)")
    limits = parser.add_argument_group("limits")
    limits.add_argument("--schedules", type=_names(SIMULATED_SCHEDULES), default=SIMULATED_SCHEDULES,
                        help="schedules to consider, comma-separated (default: all the simulator plays)")
    limits.add_argument("--checkpoints", type=_names(PLANNED_CHECKPOINTS), default=PLANNED_CHECKPOINTS,
                        help="recomputation policies to consider, selective among them (always, with the selective "
                             "unit) (default: all)")
    limits.add_argument("--fsdp-reshard", choices=FSDP_RESHARD, default="auto",
                        help="FSDP layouts: reshard weights after forward never, always, or auto (at pp 1; in a "
                             "pipeline where the gathered weights would not fit) (default: auto)")
    limits.add_argument("--offload-activations", choices=("off", "on", "both"), default="off",
                        help="consider activation offloading: off, on, or both (default: off)")
    limits.add_argument("--dp-modes", "--dp-mode", type=_names(DP_MODES), default=DP_MODES,
                        help="ddp, fsdp, hsdp (FSDP within shard groups of a node's ranks, replicated across nodes: "
                             "searched where the GPUs span nodes, or with --dp-shard) (default: ddp,fsdp,hsdp)")
    limits.add_argument("--dp-shard", type=int, default=None, metavar="K",
                        help="hsdp: shard groups of K data replicas (with --cp, K replicas and their cp ranks) "
                             "(default: the replicas of one node)")
    limits.add_argument("--max-pp", type=int, default=None, help="largest pipeline degree to consider")
    limits.add_argument("--pp", type=int, default=None, help="consider only this pipeline degree")
    limits.add_argument("--tp", type=int, default=None,
                        help="consider only this tensor-parallel degree (default: every degree dividing a node's "
                             "GPUs, when this pipetrain trains with --tp; else 1)")
    limits.add_argument("--sequence-parallel", choices=("on", "off", "both"), default="both",
                        help="tensor-parallel layouts with sequence parallelism, without, or both (default: both)")
    limits.add_argument("--ep", type=int, default=None,
                        help="a mixture-of-experts model: consider only this expert-parallel degree (default: every "
                             "power of 2 that divides the experts and dp)")
    limits.add_argument("--moe-imbalance", type=float, default=1.0, metavar="F",
                        help="a mixture-of-experts model: the busiest expert's tokens over the mean (default: 1.0, "
                             "a balanced router; with an auxiliary loss 1.1-1.3 is common)")
    limits.add_argument("--moe-overlap", choices=("on", "off", "both"), default=None,
                        help="a mixture-of-experts model under dualpipev at ep > 1: price its fused pairs overlapped "
                             "(train's --moe-overlap on: each half's all-to-all hidden behind the other's compute; "
                             "nothing hidden on CPU), in turn, or both ways, `+ov` in the table (default: both where "
                             "the model has experts and dualpipev is searched, else off)")
    limits.add_argument("--cp", type=int, default=1,
                        help="context parallelism: each sequence split over this many ranks of a stage (default: 1)")
    limits.add_argument("--cp-attention", choices=CP_ATTENTIONS, default="ring",
                        help="the attention of a context-parallel split: ring (key/value passes overlapped with "
                             "attention) or ulysses (all-to-all to whole heads) (default: ring)")
    limits.add_argument("--max-chunks", type=int, default=64, help="most micro-batches per replica (default: 64)")
    limits.add_argument("--chunks", type=int, default=None, help="consider only this many micro-batches per replica")
    limits.add_argument("--stages-per-rank", type=int, default=None,
                        help="consider only this many stages per rank for interleaved-1f1b and zero-bubble")
    what_if = parser.add_argument_group(
        "what-if (engine features pipetrain's train does not have: to compare with other trainers)")
    limits.add_argument("--recompute-unit", choices=RECOMPUTE_UNITS, default="stage",
                        help="what a recomputing micro-batch checkpoints: its whole stage, keeping the stage's input "
                             "(default), each layer alone, keeping every layer's input (torchtitan's and Megatron's "
                             "full recomputation), or selective (each layer keeps its products' outputs)")
    limits.add_argument("--selective-matmuls", choices=("all", "alternate", "both"), default="both",
                        help="under selective recomputation: price blocks keeping all their matrix products, every "
                             "other one (alternate; `sel-alt` in the table), or both ways (default: both)")
    limits.add_argument("--recompute-every", type=int, default=1, metavar="K",
                        help="with --recompute-unit layer|selective: only every K-th block recomputes (default: 1)")
    limits.add_argument("--loss-parallel", action="store_true",
                        help="with --model: price train's --loss-parallel, the embedding and the head split over tp "
                             "by vocabulary (torchtitan's loss parallelism); the train line printed carries it")
    what_if.add_argument("--vocab-parallel", action=_VocabParallel, nargs=0, help="deprecated: --loss-parallel")
    what_if.add_argument("--keep-outputs", action="store_true",
                         help="the last stage's outputs kept by torch's schedule to the step's end and merged there "
                              "(torchtitan's loop; pipetrain's train drops each micro-batch's after its loss)")
    what_if.add_argument("--bf16-logits", action="store_true",
                         help="with --model and --precision bf16: the head's logits kept in bf16 (torchtitan's model "
                              "returns them uncast, its loss casts a copy to fp32; pipetrain's stage outputs fp32)")
    what_if.add_argument("--float8", action="store_true",
                         help="with --precision bf16: Float8 projections gathered by FSDP in float8 (1 byte per "
                              "weight; torchtitan's enable_fsdp_float8_all_gather); rates stay the device's")

    limits.add_argument("--top", type=int, default=10, help="layouts to print (default: 10)")

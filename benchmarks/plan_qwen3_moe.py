"""`pipetrain plan` of Qwen3-30B-A3B beside Megatron-Bridge's published H100 row, at ep 1, 2, 4 and 8.

    python benchmarks/plan_qwen3_moe.py

Megatron-Bridge's performance summary (DGX-H100) lists Qwen3-30B-A3B pre-training on 16 H100 at PP 2, VP 24, EP 8 in
FP8 at 5,275 tokens/s/GPU and 121 model TFLOP/s/GPU. Assumed for the plan, as the row does not state them here:
global batch 512 sequences of 4096 tokens, micro-batches of one sequence (64 per replica), DDP (dp = 8), no
recomputation. The planner has no FP8 rates: it plans bf16 on the H100 data sheet (`--gpu h100-sxm`, 950 TFLOP/s
effective), so its throughput is a bf16 figure beside an FP8 one. Its TFLOP/s counts the attention's full causal
square (6N + 12·L·q·s, `pipetrain.logs.mfu`) where Megatron counts half of it. Memory: pipetrain keeps fp32 weights,
gradients and AdamW moments per parameter (Megatron: bf16 weights, fp32 gradients and a distributed optimizer).
"""

from __future__ import annotations

from pathlib import Path
from unittest.mock import patch

from pipetrain.cli.main import build_parser
from pipetrain.cli.plan import planned
from pipetrain.plan import experts

CONFIG = Path(__file__).resolve().parent / "models" / "qwen3-30b-a3b" / "config.json"
PUBLISHED = {"tokens/s/GPU": 5275, "TFLOP/s/GPU": 121}
SEQ, BATCH, GPUS = 4096, 512, 16
LAYOUT = ["plan", "--model", str(CONFIG), "--seq-len", str(SEQ), "--nodes", "2", "--gpus-per-node", "8",
          "--gpu", "h100-sxm", "--gpu-mem", "1000", "--precision", "bf16", "--tp", "1", "--pp", "2",
          "--stages-per-rank", "24", "--schedules", "interleaved-1f1b", "--dp-modes", "ddp", "--checkpoints",
          "never", "--batch", str(BATCH), "--chunks", "64", "--top", "1"]


def main() -> None:
    print("| ep | planned tokens/s/GPU | / published | planned TFLOP/s/GPU (pipetrain's count) | "
          "GiB per GPU, first / last stage | bubble | step / step without the all-to-all |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for ep in (1, 2, 4, 8):
        argv = LAYOUT + ["--ep", str(ep)]
        args = build_parser(argv).parse_args(argv)
        result, _ = planned(args)
        best = result.best[0]
        with patch.object(experts, "_a2a_s", lambda *_: 0.0):  # the same layout, its exchanges free
            bare = planned(build_parser(argv).parse_args(argv))[0].best[0]
        tokens = BATCH * SEQ / best.step_s / GPUS
        flops = args.model_sizes.flops_per_token(SEQ) * tokens / 1e12
        print(f"| {ep} | {tokens:,.0f} | {tokens / PUBLISHED['tokens/s/GPU']:.3f} | {flops:.0f} | "
              f"{best.memory_bytes[0] / 2**30:.1f} / {best.memory_bytes[-1] / 2**30:.1f} | {best.bubble:.1%} | "
              f"{best.step_s / bare.step_s:.3f} |")
    print(f"\npublished (FP8): {PUBLISHED['tokens/s/GPU']:,} tokens/s/GPU, {PUBLISHED['TFLOP/s/GPU']} TFLOP/s/GPU")


if __name__ == "__main__":
    main()

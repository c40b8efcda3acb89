#!/usr/bin/env bash
# Measure pipetrain's GPU path on ONE GPU in under 8 minutes and write one small report file.
#
#   scripts/gpu-check.sh [--dry-run] [--out DIR]     (report: DIR/gpu-check-report.txt, default DIR gpu-check-out)
#
# Steps (each line of the report names its step):
#   1. the one-GPU test tier: pytest tests/gpu (pp=1 fp32/TF32, fp32-strict, bf16, recomputation; resume with the
#      CUDA RNG restored; CUDA<->CPU checkpoints; OOM under a memory limit; the duplicate-GPU refusal);
#   2. the seed-sized `gpu` preset at pp=1 in bf16 and fp32 (TF32): pipetrain's step against a plain PyTorch loop on
#      the same model and batch (overhead ratio), tokens/s, MFU, and the planner's prediction for that run;
#   3. recomputation's memory saving: bf16 with --checkpoint always against never (peak allocated and reserved);
#   4. `pipetrain profile`'s per-block total and the calibration's single-GPU part (the layer's rate by micro-batch
#      size) next to the synchronised step measurement (the two-rank parts need two GPUs: `plan --calibrate`).
# --dry-run runs the same steps on the CPU at the tiny size (the tier then skips itself): it tests the script.
# Environment: PYTHON (default: python3) runs everything, with this checkout's src/ first on PYTHONPATH.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=gpu-check-out
DRY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --out) OUT=${2:?--out needs a folder}; shift ;;
    -h|--help) sed -n '2,17p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "gpu-check.sh: unknown argument '$1' (hint: --dry-run, --out DIR)" >&2; exit 2 ;;
  esac
  shift
done
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
mkdir -p "$OUT"
REPORT="$OUT/gpu-check-report.txt"

if [ "$DRY" = 1 ]; then
  DEVICE=cpu PRESET=tiny STEPS=2 WARMUP=0 CALIBRATE=4 TIER_TIMEOUT=120
else
  DEVICE=cuda PRESET=gpu STEPS=10 WARMUP=3 CALIBRATE=64 TIER_TIMEOUT=300
  "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' || {
    echo "gpu-check.sh: no CUDA device visible (hint: run on a GPU node, or --dry-run for the CPU rehearsal)" >&2
    exit 2
  }
fi
export PIPETRAIN_DEVICE=$DEVICE
START=$(date +%s)

{
  echo "# pipetrain gpu-check $(date -u +%Y-%m-%dT%H:%M:%SZ) device=$DEVICE preset=$PRESET dry_run=$DRY"
  echo "# commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  "$PY" -c 'import torch; print("# torch", torch.__version__, "cuda", torch.version.cuda,
          torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")'
} > "$REPORT"

# 1. the one-GPU tier (on the CPU every test of tests/gpu skips itself)
tier=$(cd "$ROOT" && timeout "$TIER_TIMEOUT" "$PY" -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tail -1) || true
echo "tier: ${tier:-no pytest summary (timed out?)}" >> "$REPORT"

# 2-4. steps, memory, profile and the calibration's single-device part, in one process (one torch import)
(cd "$ROOT" && timeout 360 "$PY" benchmarks/gpu_step.py --device "$DEVICE" --preset "$PRESET" \
    --runs bf16:never,fp32:never,bf16:always --steps "$STEPS" --warmup "$WARMUP" --calibrate "$CALIBRATE" --profile) \
  | sed 's/^/step: /' >> "$REPORT"

echo "seconds: $(( $(date +%s) - START ))" >> "$REPORT"
echo "wrote $REPORT"

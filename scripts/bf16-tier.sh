#!/usr/bin/env bash
# The bf16 and compiled-stage tier (`pytest -m bf16`) under every set of CPU kernels this machine has:
# ATEN_CPU_CAPABILITY=default and avx2, and avx512 where the CPU has it. The variable only lowers torch's choice (it
# cannot enable what the CPU lacks); torch's oneDNN kernels choose their own instruction set, lowered by
# ONEDNN_MAX_CPU_ISA, so a last run takes both down to AVX2, as on a CPU without AVX-512. One pytest summary line per
# run; the exit status is non-zero if any run failed. Extra arguments go to pytest.
# Usage: bash scripts/bf16-tier.sh [pytest args]   (PY: the interpreter, default .venv/bin/python)
set -u
PY=${PY:-.venv/bin/python}
best=$(env -u ATEN_CPU_CAPABILITY "$PY" -c "import torch; print(torch.backends.cpu.get_cpu_capability().lower())")
case $best in
    avx512) runs="default avx2 avx512 avx2+onednn-avx2" ;;
    avx2) runs="default avx2" ;;
    *) runs="default" ;;
esac
summary=""
failed=0
log=$(mktemp)
trap 'rm -f "$log"' EXIT
for run in $runs; do
    cap=${run%%+*}
    onednn=()
    [ "$run" != "$cap" ] && onednn=(ONEDNN_MAX_CPU_ISA=AVX2)
    label="ATEN_CPU_CAPABILITY=$cap${onednn[*]:+ ${onednn[*]}}"
    echo "== $label"
    # each setting compiles into its own inductor cache: torch's cache key does not hold ATEN_CPU_CAPABILITY, and a
    # kernel cached under avx512 fails to compile under default ("'at::vec' has not been declared")
    cache=$(mktemp -d)
    env ATEN_CPU_CAPABILITY="$cap" TORCHINDUCTOR_CACHE_DIR="$cache" "${onednn[@]}" "$PY" -m pytest -q -m bf16 "$@" 2>&1 | tee "$log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
    rm -rf "$cache"
    summary="$summary
$label: $(tail -n 1 "$log")"
done
echo "== the bf16 tier on this CPU (best capability: $best):$summary"
exit $failed

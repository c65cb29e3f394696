#!/usr/bin/env bash
# One prepared command for a lent GPU machine (H100/H200, a fresh copy of this repository):
#
#   OUT=/some/dir bash benchmarks/gpu_check.sh      # $OUT defaults to ./gpu-check-out
#
# 1. installs fxprobe quietly (editable) if it does not import, prints nvidia-smi and versions;
# 2. runs tests/test_stats.py and tests/test_cuda.py on CUDA (FXPROBE_TEST_DEVICE=cuda: the Triton kernel where Triton
#    is installed, its torch fallback, stats_vectors, no host sync, no graph break);
# 3. the statistics microbenchmark on CUDA: stats_vector (Triton) and its torch fallback against
#    one read of the tensor, 4 KiB .. 64 MiB, and the 97755d0 implementation;
# 4. the suite on resnet50, gpt2 and chain, modes reference/stats/offload, --rounds 5, one
#    process per model (each writes results.json as it goes, so a step cut by its time limit
#    still leaves what it measured), then one merged report.
#
# $OUT receives at most 7 files (the device tool brings back 8): gpu_check.log,
# stats_micro.{json,md}, $DEVICE-<model>.json per model, $DEVICE.md (the merged report); the
# suite's own output folders stay in a scratch directory.
# Every step is bounded by `timeout`; the whole script stays under 8 minutes (about 7 at most:
# 120 s of tests, 90 s of microbenchmark, SUITE_BUDGET=300 s of suite, 20 s of report). A failed step is
# reported and the next one runs; the exit status is the number of failed steps.
# DEVICE=cpu SUITE_ARGS=--quick runs the same steps on a CPU (a check of the script itself).
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-check-out}"
DEVICE="${DEVICE:-cuda}"
PY="${PYTHON:-python3}"  # on the lent machines, python3 is the one with torch
read -r -a suite_args <<< "${SUITE_ARGS:-}"
SCRATCH="$(mktemp -d "${TMPDIR:-/tmp}/fxprobe-gpu-check.XXXXXX")"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
failed=0
step() {  # step SECONDS NAME COMMAND...: run one bounded step, count its failure
    local limit=$1 name=$2
    shift 2
    echo "=== $(date -u +%H:%M:%S) $name (limit ${limit}s)"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@"
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - t0))s"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

if ! "$PY" -c "import fxprobe" 2>/dev/null; then
    "$PY" -m pip install -q -e . || echo "pip install -e . failed"
fi
nvidia-smi || echo "nvidia-smi failed"
"$PY" - <<'EOF'
import importlib.util, subprocess, torch
import fxprobe
print("torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
print("triton", importlib.util.find_spec("triton") is not None, "fxprobe", fxprobe.__file__)
print("commit", subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                               text=True).stdout.strip() or "unknown (no git)")
EOF

step 120 "stats and CUDA-path tests on $DEVICE" env FXPROBE_TEST_DEVICE="$DEVICE" \
    "$PY" -m pytest -q -p no:cacheprovider -rs tests/test_stats.py tests/test_cuda.py
step 90 "stats microbenchmark on $DEVICE" \
    "$PY" -m benchmarks.stats_micro --device "$DEVICE" --rounds 7 --out "$OUT"
# The suite shares what is left of SUITE_BUDGET seconds (default 300) among the models still
# to run, so a model that finishes early leaves its time to the next.
jsons=()
models=(chain gpt2 resnet50)
suite_start=$SECONDS
for i in "${!models[@]}"; do
    model=${models[$i]}
    left=$(( ${SUITE_BUDGET:-300} - (SECONDS - suite_start) ))
    limit=$(( left / (${#models[@]} - i) ))
    [ "$limit" -ge 20 ] || limit=20
    step "$limit" "suite: $model" "$PY" -m benchmarks --device "$DEVICE" --models "$model" \
        --modes reference,stats,offload --rounds 5 --no-compile --no-plot --quiet \
        "${suite_args[@]}" --out "$SCRATCH/$model"
    # results.json is rewritten after every group: a step cut short still left one.
    if [ -f "$SCRATCH/$model/results.json" ]; then
        cp "$SCRATCH/$model/results.json" "$OUT/$DEVICE-$model.json"
        jsons+=("$OUT/$DEVICE-$model.json")
    fi
done
if [ ${#jsons[@]} -gt 0 ]; then
    step 20 "merged report" "$PY" -m benchmarks --from-json "${jsons[@]}" --no-plot \
        --quiet --out "$SCRATCH/merged"
    cp "$SCRATCH/merged/results.md" "$OUT/$DEVICE.md" 2>/dev/null
fi
echo "=== done: $failed failed step(s); results under $OUT"
sleep 1  # let tee write the last lines
exit "$failed"

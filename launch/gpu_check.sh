#!/usr/bin/env bash
# The one prepared GPU check: CUDA numerics tests, the hardware bench, a 50-step demo in BF16 and
# NVFP4 (emulated), everything written to one folder. Run from the repository root:
#
#   bash launch/gpu_check.sh                    # OUT=runs/gpu_check; < 8 min on one H200
#   OUT=/tmp/x GPU_CHECK_QUICK=1 bash launch/gpu_check.sh   # CI mode: < 2 min on 2 CPU cores
#
# On a machine without CUDA it degrades to the CPU rows (quick bench, a short demo) and says so.
# Environment: OUT (output folder), PYTHON (default: python), GPU_CHECK_QUICK=1 (smallest
# settings), NVFP4_CACHE (demo corpus cache), DEMO_STEPS (default 50 on CUDA, 4 on CPU, 2 quick), WHEELS (a folder of wheels for
# an offline install of missing dependencies), GPU_CHECK_NO_INSTALL=1 (never pip install),
# BENCH_TRAIN_MODELS (GPU: default demo,1b; "demo" drops the ~1B hybrid's steps).
# Time limits per part (worst case ~11 min): CUDA tests 120 s, bench 330 s, each demo 120 s;
# expected on one H200 ~5-7 min (untested: no GPU was available when this was written).
# Exit status: 0 if every part passed, else 1 (each part's status is in $OUT/summary.md).
set -uo pipefail

cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_check}
PYTHON=${PYTHON:-python}
QUICK=${GPU_CHECK_QUICK:-0}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/gpu_check.log"
: > "$LOG"
export PYTHONUNBUFFERED=1
# the demo corpus cache: NVFP4_CACHE if set, else the repo default (.cache), built on first use
say() { echo "[gpu_check $(date +%H:%M:%S)] $*" | tee -a "$LOG"; }
START=$(date +%s)
declare -a RESULTS=()

# Run one part with a time limit; record its status and duration. Usage: part NAME LIMIT_S CMD...
part() {
    local name=$1 limit=$2; shift 2
    local t0=$(date +%s) rc
    say "== $name: $*"
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    tail -n 40 "$OUT/$name.log" >> "$LOG"
    local dt=$(( $(date +%s) - t0 ))
    if [ $rc -eq 0 ]; then RESULTS+=("| $name | ok | ${dt} s |"); say "$name: ok (${dt} s)";
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then RESULTS+=("| $name | TIMEOUT after ${limit} s | ${dt} s |"); say "$name: timed out";
    else RESULTS+=("| $name | FAILED (exit $rc) | ${dt} s |"); say "$name: failed (exit $rc), see $OUT/$name.log"; fi
    return 0
}

# -- 1. dependencies: install what is missing, never touching the installed torch ----------------
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    say "PyTorch is not importable with $PYTHON: install a CUDA build of torch first"; exit 1
fi
if ! "$PYTHON" -c "import megatron.core, hydra, omegaconf, einops, tokenizers, rich, pytest, psutil" 2>/dev/null; then
    if [ "${GPU_CHECK_NO_INSTALL:-0}" = 1 ]; then
        say "dependencies missing and GPU_CHECK_NO_INSTALL=1"; exit 1
    fi
    TORCH_VERSION=$("$PYTHON" -c "import torch; print(torch.__version__)")
    echo "torch==$TORCH_VERSION" > "$OUT/constraints.txt"   # keeps pip from replacing torch
    PIP_ARGS=(-m pip install --quiet -c "$OUT/constraints.txt" -e ".[dev]")
    if [ -n "${WHEELS:-}" ]; then PIP_ARGS+=(--no-index --find-links "$WHEELS"); fi
    say "installing the project's dependencies (torch pinned to $TORCH_VERSION)"
    if ! "$PYTHON" "${PIP_ARGS[@]}" >> "$LOG" 2>&1; then
        say "pip install failed (no network? set WHEELS=<folder of wheels>); see $LOG"; exit 1
    fi
fi

# -- 2. what machine is this --------------------------------------------------------------------
"$PYTHON" - > "$OUT/hardware.json" <<'EOF'
import json
from nvfp4_recipe.benchmarking import device_info
print(json.dumps(device_info(), indent=2, default=str))
EOF
HAS_CUDA=$("$PYTHON" -c "import torch; print(int(torch.cuda.is_available()))")
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
if [ "$HAS_CUDA" = 1 ]; then
    MODE=gpu
    say "CUDA device: $("$PYTHON" -c "import torch; p=torch.cuda.get_device_properties(0); print(p.name, f'cc {p.major}.{p.minor}')")"
else
    MODE=cpu
    say "NO CUDA DEVICE: running the CPU rows only (quick bench, short demo); GPU results are NOT produced"
fi

if [ "$QUICK" = 1 ]; then
    BENCH_ARGS=(--quick --repeats 1); DEMO_STEPS=${DEMO_STEPS:-2}; DEMO_SHAPE=(trainer.seq_length=64 trainer.global_batch_size=2 trainer.micro_batch_size=2)
elif [ "$MODE" = gpu ]; then
    BENCH_ARGS=(--train-models "${BENCH_TRAIN_MODELS:-demo,1b}"); DEMO_STEPS=${DEMO_STEPS:-50}; DEMO_SHAPE=()
else
    BENCH_ARGS=(--quick); DEMO_STEPS=${DEMO_STEPS:-4}; DEMO_SHAPE=(trainer.seq_length=128 trainer.global_batch_size=4 trainer.micro_batch_size=2)
fi
DEMO_COMMON=(trainer.max_steps="$DEMO_STEPS" trainer.warmup_steps=2 trainer.eval_every=1000000
             trainer.save_every=1000000 trainer.eval_batches=1 logger.mode=disabled run.resume=never "${DEMO_SHAPE[@]}")

# -- 3. the parts ---------------------------------------------------------------------------------
part cuda_tests 120 "$PYTHON" -m pytest -q -rs tests/test_cuda_numerics.py --junitxml="$OUT/cuda_tests.xml" -p no:cacheprovider
part bench 330 "$PYTHON" -m launch.bench "${BENCH_ARGS[@]}" --json "$OUT/bench.json"
rm -rf "$OUT/demo_bf16" "$OUT/demo_nvfp4"
part demo_bf16 120 "$PYTHON" train.py precision=bf16 run.dir="$OUT/demo_bf16" "${DEMO_COMMON[@]}"
part demo_nvfp4 120 "$PYTHON" train.py precision=nvfp4 precision.backend=emulated run.dir="$OUT/demo_nvfp4" "${DEMO_COMMON[@]}"

# -- 4. summary -----------------------------------------------------------------------------------
{
    echo "# gpu_check ($MODE mode$( [ "$QUICK" = 1 ] && echo ', quick'))"
    echo
    [ "$MODE" = cpu ] && echo "**No CUDA device was visible: these are CPU rows only; no GPU result was produced.**" && echo
    echo "Started $(date -d @"$START" '+%F %T'), took $(( $(date +%s) - START )) s. Load average at end: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)."
    echo
    echo "| part | status | time |"
    echo "|---|---|---|"
    printf '%s\n' "${RESULTS[@]}"
    echo
    "$PYTHON" - "$OUT" <<'EOF'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
for name in ("demo_bf16", "demo_nvfp4"):
    path = out / name / "metrics.jsonl"
    if not path.exists():
        print(f"- {name}: no metrics.jsonl"); continue
    steps = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
    steps = [s for s in steps if "tokens_per_sec" in s]
    warm = steps[2:]
    tps = [s["tokens_per_sec"] for s in (warm or steps)]
    if steps:
        which = "steps 3+" if warm else "all steps, incl. warm-up"
        print(f"- {name}: {len(steps)} steps, loss {steps[0]['loss']:.3f} -> {steps[-1]['loss']:.3f}, "
              f"median tokens/s ({which}) {statistics.median(tps):,.0f}")
bench = out / "bench.md"
if bench.exists():
    print("\n## bench\n")
    print(bench.read_text())
EOF
} > "$OUT/summary.md" 2>&1
cat "$OUT/summary.md" | tee -a "$LOG"
say "everything is in $OUT"
for r in "${RESULTS[@]}"; do case "$r" in *"| ok |"*) ;; *) exit 1;; esac; done
exit 0

#!/usr/bin/env bash
# The one prepared GPU check, for one GPU with no network. Planned machine: one H200 (cc 9.0),
# Python 3.12, torch 2.11 (CUDA 13), triton, nvcc and pytest; no Transformer Engine, megatron-core
# or mamba_ssm. Run from the repository root:
#
#   make gpu-wheels                            # anywhere with network: .wheels/ (< 40 MiB), then copy the repo over
#   WHEELS=.wheels bash launch/gpu_check.sh    # on the GPU machine: OUT=runs/gpu_check, one 10-min command (540 s budget)
#   OUT=/tmp/x GPU_CHECK_QUICK=1 bash launch/gpu_check.sh   # CI (CPU mode): ~4 min on 2 loaded cores
#
# Parts, in order (correctness first, timings last); each is "ok", "FAILED (...)" or
# "skipped: <reason>" in $OUT/summary.md:
#   deps        installs what the check imports and the machine lacks: from $WHEELS offline with
#               --no-deps into $GPU_CHECK_SITE (put first on PYTHONPATH; torch and the rest of the
#               machine's environment untouched), or without WHEELS from the index, torch pinned
#   gpu_path    launch/gpu_path_check.py --sections sdpa,scan,grad_norm (nothing to compile):
#               SDPACoreAttention on megatron's fused-QKV views under each SDPA backend vs math in
#               FP32, which backend torch picks; which Mamba scan runs; megatron's grad-norm fallback
#   cuda_tests  tests/nvfp4_recipe/test_cuda_numerics.py: the NVFP4 emulation on CUDA is bit-exact to CPU,
#               never synchronizes (set_sync_debug_mode "error"), FP32 GEMMs IEEE unless TF32 is on
#   ssd_triton  mamba_ssm's Triton SSD scan vs the mixer's PyTorch scan, fwd+bwd (model/ssd_check.py)
#   warmup      one step of the NVFP4 demo: compiles what the parts after it run (Triton SSD
#               kernels, inductor's quantizers) into Triton's and inductor's disk caches
#   gpu_sync    launch/gpu_path_check.py --sections sync: synchronizing calls per micro-batch
#               (a 1- against a 2-micro-batch step), and the emulated linear under mode "error"
#   demo_bf16   DEMO_STEPS + 2 (GPU 32) steps of the demo, a checkpoint at DEMO_STEPS: BF16 weights,
#               megatron's DDP and distributed optimizer (DP=1, dp_reshardable state), megatron's
#               schedule (on CUDA), full activation recompute
#   resume      demo_bf16 resumed from its step-DEMO_STEPS checkpoint (training/safe_load.py) for
#               the 2 last steps: the same losses as the uninterrupted run (launch/gpu_check_plan.py)
#   demo_nvfp4  DEMO_STEPS steps with emulated NVFP4 GEMMs
#   demo_moe    MOE_STEPS (GPU 10) steps of the hybrid MoE demo (model=demo_moe), NVFP4 experts:
#               megatron's all-to-all token dispatcher with its CUDA-stream copies, the FP32
#               router, expert load and aux loss in the metrics
#   bench       python -m benchmarks.hardware: GEMMs at 12B shapes; training tokens/s and MFU of
#               the demo and (GPU) of the ~1B hybrid, BF16 and NVFP4
# Without CUDA it runs the same parts in CPU mode (the CUDA parts skip with the reason, small
# demos, the resume and the quick bench) and says so.
#
# Time: one command of the device tool may run 600 s. Before each part the script asks
# launch/gpu_check_plan.py (decide) whether the part's estimate fits what is left of the budget
# (GPU 540 s, CPU 900 s) and runs it under min(its limit, what is left); a part that does not fit
# is skipped with the reason. The plan the estimates give is at the top of the summary; nothing of
# it has been timed on a GPU yet. Compiles: every part that trains loads mamba_ssm's Triton SSD
# kernels with MAMBA_DETERMINISTIC=1 (one config per autotuned kernel instead of ~200 configs;
# mamba v2.3.2.post1 mamba_ssm/utils/determinism.py:59-77, also its deterministic reductions),
# unless GPU_CHECK_AUTOTUNE=1; the warmup part compiles them once for the parts after it.
#
# Environment: OUT, PYTHON (default python, else python3), WHEELS (wheelhouse for an offline install),
# GPU_CHECK_NO_INSTALL=1 (never install), GPU_CHECK_QUICK=1 (smallest settings), GPU_CHECK_PARTS
# (comma list, default all), GPU_CHECK_BUDGET_S (whole run; GPU default 540 s), GPU_CHECK_SITE
# (default .cache/gpu_check_site), GPU_CHECK_AUTOTUNE=1 (mamba's full autotuning), DEMO_STEPS, MOE_STEPS,
# BENCH_TRAIN_MODELS (GPU default demo,1b), NVFP4_CACHE (demo corpus cache). Exit status 0 when no
# part failed (skips are not failures), else 10 (errors.ExitCode.CHECK_FAILED).
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
REPO=$(pwd)
# Exit codes, errors.ExitCode's (tests/test_errors.py checks that they agree): a part that
# reports itself skipped exits EXIT_SKIPPED; this script exits EXIT_CHECK_FAILED when a part failed.
EXIT_MISSING=3
EXIT_UNWRITABLE=8
EXIT_CHECK_FAILED=10
EXIT_SKIPPED=77
OUT=${OUT:-runs/gpu_check}
PYTHON=${PYTHON:-$(command -v python || command -v python3 || echo python)}
QUICK=${GPU_CHECK_QUICK:-0}
ALL_PARTS=deps,gpu_path,cuda_tests,ssd_triton,warmup,gpu_sync,demo_bf16,resume,demo_nvfp4,demo_moe,bench
PARTS=${GPU_CHECK_PARTS:-$ALL_PARTS}
SITE=${GPU_CHECK_SITE:-$REPO/.cache/gpu_check_site}
mkdir -p "$OUT" || { echo "gpu_check: cannot create OUT=$OUT" >&2; exit $EXIT_UNWRITABLE; }
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/gpu_check.log"
# a rerun (e.g. of some parts) must not report an earlier run's results
for f in deps.log deps.md deps_plan.txt deps_imports.txt plan.txt cuda_tests.log cuda_tests.xml gpu_path.log gpu_path.json \
         ssd_triton.log ssd_triton.json warmup.log warmup gpu_sync.log gpu_sync.json demo_bf16.log demo_bf16 \
         resume.log resume demo_nvfp4.log demo_nvfp4 demo_moe.log demo_moe bench.log bench.json bench.md; do
    rm -rf "${OUT:?}/$f"
done
: > "$LOG"
export PYTHONUNBUFFERED=1
say() { echo "[gpu_check $(date +%H:%M:%S)] $*" | tee -a "$LOG"; }
START=$(date +%s)
declare -a RESULTS=()
FAILED=0

if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    say "PyTorch is not importable with PYTHON=$PYTHON: install a CUDA build of torch first"; exit $EXIT_MISSING
fi
if [ "$("$PYTHON" -c "import torch; print(int(torch.cuda.is_available()))")" = 1 ]; then MODE=gpu; else MODE=cpu; fi
# The budget and each part's estimate and limit: launch/gpu_check_plan.py (BUDGET_S, GPU_PARTS, CPU_PARTS).
BUDGET=${GPU_CHECK_BUDGET_S:-$("$PYTHON" -c "from launch.gpu_check_plan import BUDGET_S; print(BUDGET_S['$MODE'])")}
KILL_AFTER=10

selected() { [[ ",$PARTS," == *",$1,"* ]]; }
record() {  # NAME STATUS SECONDS
    RESULTS+=("| $1 | $2 | $3 s |")
    case "$2" in ok|skipped*) ;; *) FAILED=1 ;; esac
    write_summary
}

# Run one part, if launch/gpu_check_plan.py says it fits what is left of the budget, under the
# limit it gives. Usage: part NAME CMD... A command reports "skipped" by printing
# "skipped: <reason>" as its last line and exiting 77; a pytest part whose tests were all skipped
# (junit file in $JUNIT) is reported skipped with pytest's first reason.
part() {
    local name=$1; shift
    if ! selected "$name"; then record "$name" "skipped: not in GPU_CHECK_PARTS=$PARTS" 0; return 0; fi
    local left decision limit
    left=$(( BUDGET - ($(date +%s) - START) - KILL_AFTER - 5 ))
    decision=$("$PYTHON" -m launch.gpu_check_plan decide --mode "$MODE" --part "$name" --left "$left" --budget "$BUDGET" 2>> "$LOG")
    case "$decision" in
        "run "*) limit=${decision#run } ;;
        "skip "*) say "$name: skipped: ${decision#skip }"; record "$name" "skipped: ${decision#skip }" 0; return 0 ;;
        *) record "$name" "FAILED (launch/gpu_check_plan.py decide gave '$decision', see gpu_check.log)" 0; return 0 ;;
    esac
    local t0 rc status
    t0=$(date +%s)
    say "== $name (limit ${limit} s): $*"
    timeout --kill-after=$KILL_AFTER "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    tail -n 40 "$OUT/$name.log" >> "$LOG"
    local dt=$(( $(date +%s) - t0 ))
    if [ $rc -eq 0 ] && [ -n "${JUNIT:-}" ] && [ -f "$JUNIT" ]; then
        local why
        why=$("$PYTHON" - "$JUNIT" <<'EOF'
import sys, xml.etree.ElementTree as ET
cases = list(ET.parse(sys.argv[1]).getroot().iter("testcase"))
skips = [c.find("skipped") for c in cases]
if cases and all(s is not None for s in skips):
    print(" ".join(skips[0].get("message", "no reason given").split()))
EOF
)
        [ -n "$why" ] && rc=$EXIT_SKIPPED && echo "skipped: $why" >> "$OUT/$name.log"
    fi
    if [ $rc -eq 0 ]; then status=ok
    elif [ $rc -eq $EXIT_SKIPPED ]; then status="skipped: $(grep '^skipped: ' "$OUT/$name.log" | tail -n 1 | cut -c 10- | tr '|' '/')"
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then status="FAILED (timed out after ${limit} s)"
    else status="FAILED (exit $rc, see $name.log)"; fi
    say "$name: $status (${dt} s)"
    record "$name" "$status" "$dt"
    return 0
}

write_summary() {
    {
        echo "# gpu_check ($MODE mode$( [ "$QUICK" = 1 ] && echo ', quick'))"
        echo
        [ "$MODE" = cpu ] && echo "**No CUDA device was visible: these are CPU rows only; no GPU result was produced.**" && echo
        echo "Started $(date -d @"$START" '+%F %T'), $(( $(date +%s) - START )) s so far (budget ${BUDGET} s). Load average: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)."
        echo
        echo "| part | status | time |"
        echo "|---|---|---|"
        printf '%s\n' "${RESULTS[@]}"
        echo
        if [ -f "$OUT/plan.txt" ]; then
            echo "Planned from the parts' estimates (launch/gpu_check_plan.py; decided again before each part with the time left):"
            sed 's/^/- /' "$OUT/plan.txt"; echo
        fi
        [ -n "${COMPILE_NOTE:-}" ] && echo "$COMPILE_NOTE" && echo
        [ -f "$OUT/deps.md" ] && cat "$OUT/deps.md" && echo
        local f
        for f in gpu_path gpu_sync; do
            if [ -f "$OUT/$f.log" ] && grep -q "^\(sync\|sdpa\|scan\|grad_norm\): " "$OUT/$f.log"; then
                echo "## $f (launch/gpu_path_check.py; numbers in $f.json)"; echo
                grep "^\(sync\|sdpa\|scan\|grad_norm\): " "$OUT/$f.log" | sed 's/^/- /'; echo
            fi
        done
        if [ -f "$OUT/resume.log" ] && grep -q "^resume: " "$OUT/resume.log"; then
            echo "## resume"; echo; grep "^resume: " "$OUT/resume.log" | tail -n 1 | sed 's/^/- /'; echo
        fi
        if [ -f "$OUT/ssd_triton.log" ] && grep -q "^mamba_chunk_scan_combined:" "$OUT/ssd_triton.log"; then
            echo "## ssd_triton (relative L2 error vs the float64 PyTorch scan)"; echo; echo '```'
            sed -n '/^mamba_chunk_scan_combined:/,$p' "$OUT/ssd_triton.log"; echo '```'; echo
        fi
        "$PYTHON" - "$OUT" <<'EOF'
import json, re, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
for name in ("demo_bf16", "demo_nvfp4", "demo_moe"):
    path, log = out / name / "metrics.jsonl", out / f"{name}.log"
    if not log.exists():
        continue
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
        busiest = [v for k, v in steps[-1].items() if re.fullmatch(r"moe/\d+/max_over_mean", k)]
        if busiest:  # an MoE run: its last step's expert load
            print(f"  - expert load, last step: busiest expert {max(busiest):.2f}x the mean "
                  f"(worst of {len(busiest)} MoE layers)")
    # what ran: the run's own config, then the trainer's account (layout, precision, optimizer)
    config = out / name / "config.yaml"
    if config.exists():
        keys = {}
        section = None
        wanted = ("distributed_optimizer", "recompute", "recompute_method", "recompute_layers", "checkpoint_layout")
        for line in config.read_text().splitlines():
            if line and not line.startswith(" "):
                section = line.rstrip(":")
            elif section == "trainer" and line.strip().split(":")[0] in wanted:
                k, v = line.strip().split(":", 1)
                keys[k] = v.strip()
        print("  - config: " + ", ".join(f"trainer.{k}={keys[k]}" for k in wanted if k in keys))
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith(("parallel:", "mixed precision:", "model paths:", "device:")) or re.match(r"precision \w+: ", line):
            print(f"  - {line.strip()}")
bench = out / "bench.md"
if bench.exists():
    print("\n## bench\n")
    print(bench.read_text())
EOF
    } > "$OUT/summary.md.tmp" 2>&1
    mv "$OUT/summary.md.tmp" "$OUT/summary.md"
}

# -- 1. dependencies ------------------------------------------------------------------------------
# What the check imports: the project's dependencies (pyproject.toml) except torch (the machine's)
# and wandb (imported only for logger modes other than `disabled`, training/metrics.py), plus
# pytest; mamba-ssm too when the wheelhouse has it. Prints "have|install|require|missing NAME ...".
deps_plan() {
    "$PYTHON" - "${WHEELS:-}" <<'EOF'
import importlib.metadata as md, re, sys, tomllib
from pathlib import Path
wheels_dir = sys.argv[1]
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
try:
    from packaging.requirements import Requirement
except ImportError:  # no packaging: any installed version counts
    Requirement = None
reqs = {norm(re.match(r"[A-Za-z0-9._-]+", r).group(0)): r
        for r in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]}
reqs = {n: r for n, r in reqs.items() if n not in ("torch", "wandb")} | {"pytest": "pytest"}
def installed(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
def ok(name, version):
    req = reqs.get(name)
    return version is not None and (req is None or Requirement is None
                                    or Requirement(req).specifier.contains(version, prereleases=True))
if wheels_dir:
    wheels = {norm(p.name.split("-")[0]): p for p in sorted(Path(wheels_dir).glob("*.whl"))}
    for name, path in wheels.items():
        v = installed(name)
        print(f"have {name} {v}" if ok(name, v) else f"install {name} {path.resolve()}")
    for name in reqs.keys() - wheels.keys():
        v = installed(name)
        print(f"have {name} {v}" if ok(name, v) else f"missing {name} {reqs[name]} (not in {wheels_dir})")
else:
    for name, req in reqs.items():
        v = installed(name)
        print(f"have {name} {v}" if ok(name, v) else f"require {name} {req}")
EOF
}

deps() {
    local t0 status=ok plan installs=() specs=() missing
    t0=$(date +%s)
    mkdir -p "$SITE"
    if [ -n "${WHEELS:-}" ] && [ ! -d "$WHEELS" ]; then
        status="FAILED (WHEELS=$WHEELS is not a folder; run make gpu-wheels)"
    elif ! plan=$(deps_plan 2> "$OUT/deps.log"); then
        status="FAILED (could not read the requirements, see deps.log)"
    fi
    if [ "$status" = ok ]; then
        echo "$plan" > "$OUT/deps_plan.txt"
        mapfile -t installs < <(awk '$1 == "install" {print $3}' <<< "$plan")
        mapfile -t specs < <(awk '$1 == "require" {$1 = $2 = ""; print substr($0, 3)}' <<< "$plan")
        if [ ${#installs[@]} -gt 0 ] || [ ${#specs[@]} -gt 0 ]; then
            if [ "${GPU_CHECK_NO_INSTALL:-0}" = 1 ]; then
                status="FAILED (missing and GPU_CHECK_NO_INSTALL=1: $(awk '$1 == "install" || $1 == "require" {print $2}' <<< "$plan" | tr '\n' ' '))"
            elif [ ${#installs[@]} -gt 0 ]; then
                # --no-deps: make gpu-wheels checked that the wheelhouse holds the whole closure
                # (less tokenizers' and mamba-ssm's dependencies that the check does not use);
                # --target keeps the machine's environment as it is.
                say "installing offline into $SITE: $(awk '$1 == "install" {print $2}' <<< "$plan" | tr '\n' ' ')"
                timeout $LIMIT_DEPS "$PYTHON" -m pip install --no-index --no-deps --no-compile --disable-pip-version-check \
                    --target "$SITE" "${installs[@]}" >> "$OUT/deps.log" 2>&1 \
                    || status="FAILED (pip install from $WHEELS, see deps.log)"
            else
                local torch_version
                torch_version=$("$PYTHON" -c "import torch; print(torch.__version__)")
                echo "torch==$torch_version" > "$OUT/constraints.txt"  # keeps pip from replacing torch
                say "installing from the index (torch pinned to $torch_version): ${specs[*]}"
                timeout $LIMIT_DEPS "$PYTHON" -m pip install -c "$OUT/constraints.txt" "${specs[@]}" >> "$OUT/deps.log" 2>&1 \
                    || status="FAILED (pip install failed: no network? make gpu-wheels, then WHEELS=.wheels; see deps.log)"
            fi
        fi
        missing=$(awk '$1 == "missing" {print $2}' <<< "$plan" | paste -sd ' ')
        [ -n "$missing" ] && [ "$status" = ok ] && status="FAILED (missing: $missing)"
    fi
    # What imports now (mamba_ssm only informs: model/ssd_check.py decides what its part can do).
    "$PYTHON" - "$SITE" > "$OUT/deps_imports.txt" 2>> "$OUT/deps.log" <<'EOF'
import importlib, importlib.metadata as md, os, sys, warnings
warnings.simplefilter("ignore")  # megatron warns about the absent TE/Apex; not our question here
site = os.path.realpath(sys.argv[1])
for module, dist in [("megatron.core", "megatron-core"), ("hydra", "hydra-core"), ("omegaconf", "omegaconf"),
                     ("einops", "einops"), ("tokenizers", "tokenizers"), ("numpy", "numpy"), ("rich", "rich"),
                     ("psutil", "psutil"), ("pytest", "pytest"), ("triton", "triton"), ("mamba_ssm", "mamba-ssm")]:
    try:
        version = md.version(dist)
    except md.PackageNotFoundError:
        version = None
    try:
        mod = importlib.import_module(module)
        where = "installed by deps" if os.path.realpath(getattr(mod, "__file__", None) or "/").startswith(site) else "present"
        print(f"ok {dist} {version} ({where})")
    except Exception as exc:
        print(f"FAILED {dist} {version or 'not installed'}: {type(exc).__name__}: {exc}")
EOF
    local broken
    broken=$(awk '$1 == "FAILED" && $2 != "mamba-ssm" && $2 != "triton" {print $2}' "$OUT/deps_imports.txt" | paste -sd ' ')
    grep -q '^ok megatron-core' "$OUT/deps_imports.txt" || broken="${broken:-the import check itself (see deps.log)}"
    [ -n "$broken" ] && [ "$status" = ok ] && status="FAILED (does not import: $broken)"
    {
        echo "## dependencies (deps)"; echo
        [ ${#installs[@]} -gt 0 ] && echo "Installed offline with --no-deps into \`$SITE\` (first on PYTHONPATH): $(awk '$1 == "install" {print $2}' <<< "$plan" | tr '\n' ' ')" && echo
        [ ${#specs[@]} -gt 0 ] && echo "Installed from the index, torch pinned: ${specs[*]}" && echo
        sed 's/^/- /' "$OUT/deps_imports.txt"
    } > "$OUT/deps.md"
    cat "$OUT/deps.md" >> "$LOG"
    say "deps: $status"
    record deps "$status" $(( $(date +%s) - t0 ))
}

LIMIT_DEPS=$("$PYTHON" -c "from launch.gpu_check_plan import part_named; print(part_named('$MODE', 'deps').limit_s)")
"$PYTHON" -m launch.gpu_check_plan plan --mode "$MODE" --budget "$BUDGET" --parts "$PARTS" > "$OUT/plan.txt" 2>> "$LOG"
say "plan for a ${BUDGET} s budget: $(paste -sd ';' "$OUT/plan.txt")"

# what deps installs (now or in an earlier run) comes first on every part's path
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
if selected deps; then deps; else record deps "skipped: not in GPU_CHECK_PARTS=$PARTS" 0; fi

# -- 2. what machine is this ----------------------------------------------------------------------
"$PYTHON" - > "$OUT/hardware.json" 2>> "$LOG" <<'EOF'
import json
from benchmarks.machine import device_info
print(json.dumps(device_info(), indent=2, default=str))
EOF
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
if [ "$MODE" = gpu ]; then
    say "CUDA device: $("$PYTHON" -c "import torch; p=torch.cuda.get_device_properties(0); print(p.name, f'cc {p.major}.{p.minor}, torch {torch.__version__}, CUDA {torch.version.cuda}')")"
else
    say "NO CUDA DEVICE: CPU mode (the CUDA parts skip; the warm-up, short demos, the resume and the quick bench run); GPU results are NOT produced"
fi

if [ "$QUICK" = 1 ]; then
    BENCH_ARGS=(--quick --repeats 1); DEMO_STEPS=${DEMO_STEPS:-2}; MOE_STEPS=${MOE_STEPS:-2}; DEMO_SHAPE=(trainer.seq_length=64 trainer.global_batch_size=2 trainer.micro_batch_size=2)
elif [ "$MODE" = gpu ]; then
    BENCH_ARGS=(--train-models "${BENCH_TRAIN_MODELS:-demo,1b}"); DEMO_STEPS=${DEMO_STEPS:-30}; MOE_STEPS=${MOE_STEPS:-10}; DEMO_SHAPE=()
else
    BENCH_ARGS=(--quick); DEMO_STEPS=${DEMO_STEPS:-4}; MOE_STEPS=${MOE_STEPS:-4}; DEMO_SHAPE=(trainer.seq_length=128 trainer.global_batch_size=4 trainer.micro_batch_size=2)
fi
RESUME_STEPS=2  # steps trained after the checkpoint, once uninterrupted and once resumed
# BF16 weights with FP32 main grads, megatron's DDP + distributed optimizer (DP=1 here) and, on
# CUDA, megatron's forward-backward schedule (training/ddp_optimizer.py, training/schedules.py),
# full recompute of every layer. No run.resume here: each part sets its own (hydra refuses two).
DEMO_COMMON=(trainer.warmup_steps=2 trainer.eval_every=1000000 trainer.eval_batches=1 logger.mode=disabled
             trainer.distributed_optimizer=true trainer.recompute=full "${DEMO_SHAPE[@]}")
# demo_bf16 and its resume: the same command but run.dir/run.resume; a checkpoint at DEMO_STEPS
# (and the last step), its optimizer state in the dp_reshardable layout (training/config.py).
RESUMABLE=(precision=bf16 trainer.max_steps=$(( DEMO_STEPS + RESUME_STEPS )) trainer.save_every="$DEMO_STEPS"
           trainer.keep_last=0 trainer.checkpoint_layout=dp_reshardable "${DEMO_COMMON[@]}")
if [ "$MODE" = gpu ]; then
    # step DEMO_STEPS+1 reads only restored state: bitwise; the next may differ by atomics'
    # summation order in a backward (embedding gradients) from run to run
    RESUME_RTOL=1e-3
else
    RESUME_RTOL=0  # CPU kernels add in a fixed order: every step bitwise
fi

# Triton SSD kernels at one config each (see the header), unless asked to autotune; cached
# autotuning (TRITON_CACHE_AUTOTUNING=1, triton >= 3.4) would bring every config back.
if [ "${GPU_CHECK_AUTOTUNE:-0}" = 1 ]; then
    TRAIN_ENV=(env)
    COMPILE_NOTE="mamba_ssm's Triton kernels: fully autotuned (GPU_CHECK_AUTOTUNE=1)."
else
    TRAIN_ENV=(env -u TRITON_CACHE_AUTOTUNING MAMBA_DETERMINISTIC=1)
    COMPILE_NOTE="mamba_ssm's Triton kernels in the parts that train (warmup, gpu_sync, demos, resume, bench): one config per kernel and mamba's deterministic reductions (MAMBA_DETERMINISTIC=1), so their tokens/s are a lower bound; GPU_CHECK_AUTOTUNE=1 autotunes."
fi

# -- 3. the parts: correctness first ----------------------------------------------------------------
part gpu_path "$PYTHON" -m launch.gpu_path_check --sections sdpa,scan,grad_norm --json "$OUT/gpu_path.json"
# the Triton SSD tests of test_cuda_numerics.py run in their own part (one Triton compile)
JUNIT="$OUT/cuda_tests.xml" part cuda_tests "$PYTHON" -m pytest -q -rs tests/nvfp4_recipe/test_cuda_numerics.py \
    -k "not triton_ssd" --junitxml="$OUT/cuda_tests.xml" -p no:cacheprovider
part ssd_triton "$PYTHON" -m model.ssd_check --json "$OUT/ssd_triton.json"
part warmup "${TRAIN_ENV[@]}" "$PYTHON" train.py precision=nvfp4 precision.backend=emulated run.dir="$OUT/warmup" \
    run.resume=never trainer.max_steps=1 trainer.save_every=1000000 "${DEMO_COMMON[@]}"
part gpu_sync "${TRAIN_ENV[@]}" "$PYTHON" -m launch.gpu_path_check --sections sync --json "$OUT/gpu_sync.json"
# cuBLAS gives the same bits run to run only with a fixed workspace configuration when torch
# uses more than one stream (torch's reproducibility notes); both runs get the same one.
part demo_bf16 "${TRAIN_ENV[@]}" CUBLAS_WORKSPACE_CONFIG=:4096:8 "$PYTHON" train.py run.dir="$OUT/demo_bf16" \
    run.resume=never "${RESUMABLE[@]}"
part resume "${TRAIN_ENV[@]}" CUBLAS_WORKSPACE_CONFIG=:4096:8 "$PYTHON" -m launch.gpu_check_plan resume --demo "$OUT/demo_bf16" --into "$OUT/resume" \
    --from-step "$DEMO_STEPS" --rtol "$RESUME_RTOL" -- \
    "$PYTHON" train.py run.dir="$OUT/resume" run.resume=auto "${RESUMABLE[@]}"
part demo_nvfp4 "${TRAIN_ENV[@]}" "$PYTHON" train.py precision=nvfp4 precision.backend=emulated \
    run.dir="$OUT/demo_nvfp4" run.resume=never trainer.max_steps="$DEMO_STEPS" trainer.save_every=1000000 "${DEMO_COMMON[@]}"
part demo_moe "${TRAIN_ENV[@]}" "$PYTHON" train.py model=demo_moe precision=nvfp4 precision.backend=emulated \
    run.dir="$OUT/demo_moe" run.resume=never trainer.max_steps="$MOE_STEPS" trainer.save_every=1000000 "${DEMO_COMMON[@]}"
part bench "${TRAIN_ENV[@]}" "$PYTHON" -m benchmarks.hardware "${BENCH_ARGS[@]}" --json "$OUT/bench.json"

# -- 4. summary -----------------------------------------------------------------------------------
write_summary
cat "$OUT/summary.md" | tee -a "$LOG"
say "everything is in $OUT"
[ "$FAILED" -eq 0 ] || exit $EXIT_CHECK_FAILED
exit 0

"""The decisions of launch/gpu_check.sh that need no GPU, as pure functions tested on CPU
(tests/launch/test_gpu_check.py): which part runs under which time limit, and whether a resumed
demo continued the uninterrupted one. Imports no torch: the script asks it once per part.

    python -m launch.gpu_check_plan plan --mode gpu [--budget S]       # the run's plan, one line a part
    python -m launch.gpu_check_plan decide --mode gpu --part NAME --left S   # "run LIMIT" or "skip REASON"
    python -m launch.gpu_check_plan resume --demo DIR --into DIR --from-step N --rtol R -- TRAIN ARGS...

Budget (GPU): one command of the device tool may run 600 s. The script keeps BUDGET_S = 540 s for
its parts; the other 60 s cover each part's --kill-after (10 s), the CUDA start-up of the machine
probe and the summary. A part runs only when its estimate fits what is left, under a limit of
min(its own limit, what is left), so the whole run cannot pass the budget by more than one
kill-after; what does not fit is skipped with the reason and listed in the summary.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from errors import ExitCode

# Below this many seconds no part can do anything useful (a CUDA start-up alone takes ~5-10 s).
MIN_PART_S = 15
BUDGET_S = {"gpu": 540, "cpu": 900}


@dataclass(frozen=True)
class Part:
    name: str
    estimate_s: int  # expected time on this machine, warm caches where a part before warms them
    limit_s: int  # its timeout: estimate plus room; never more than what is left of the budget
    what: str


# In the order they run: the parts that prove correctness first, then the timings. Estimates for
# the GPU are for one H200 and have not been measured (no GPU has run this script yet): compiles
# dominate them. MAMBA_DETERMINISTIC=1 makes mamba_ssm keep one config per autotuned kernel
# (mamba v2.3.2.post1 mamba_ssm/utils/determinism.py:59-77), 23 compiles instead of ~200.
GPU_PARTS = (
    Part("deps", 15, 60, "installs what the check imports"),
    Part("gpu_path", 40, 90, "SDPACoreAttention per backend vs math FP32, Mamba scan, grad norm"),
    Part("cuda_tests", 110, 180, "NVFP4 emulation on CUDA bit-exact to CPU (inductor compiles ~11 graphs)"),
    Part("ssd_triton", 60, 120, "mamba_ssm's Triton SSD scan vs the PyTorch scan"),
    Part("warmup", 90, 150, "compiles the trainer's kernels (one NVFP4 step) so later parts do not"),
    Part("gpu_sync", 40, 90, "synchronizing calls per micro-batch (1- vs 2-micro-batch step)"),
    Part("demo_bf16", 45, 90, "the BF16 demo, uninterrupted to its last step, checkpoint two steps before"),
    Part("resume", 30, 60, "demo_bf16 resumed from that checkpoint: same losses"),
    Part("demo_nvfp4", 50, 90, "the same with emulated NVFP4 GEMMs"),
    Part("demo_moe", 40, 90, "the hybrid MoE demo: NVFP4 experts, megatron's all-to-all dispatcher on CUDA"),
    Part("bench", 120, 180, "GEMMs at 12B shapes, tokens/s and MFU"),
)
# CPU mode (CI, 2 shared cores): the GPU-only parts skip themselves within seconds.
CPU_PARTS = (
    Part("deps", 20, 120, "installs what the check imports"),
    Part("gpu_path", 15, 60, "skips: needs CUDA"),
    Part("cuda_tests", 20, 120, "skips: needs CUDA"),
    Part("ssd_triton", 15, 60, "skips: needs CUDA"),
    Part("warmup", 40, 180, "one NVFP4 step (fills the inductor cache)"),
    Part("gpu_sync", 15, 60, "skips: needs CUDA"),
    Part("demo_bf16", 60, 180, "the small BF16 demo"),
    Part("resume", 40, 120, "demo_bf16 resumed: same losses"),
    Part("demo_nvfp4", 60, 180, "the small NVFP4 demo"),
    Part("demo_moe", 60, 180, "the small hybrid MoE demo, NVFP4 experts"),
    Part("bench", 120, 330, "the quick bench"),
)
PARTS = {"gpu": GPU_PARTS, "cpu": CPU_PARTS}


def part_named(mode: str, name: str) -> Part:
    for part in PARTS[mode]:
        if part.name == name:
            return part
    raise KeyError(f"no part {name!r} in {mode} mode; parts: {', '.join(p.name for p in PARTS[mode])}")


def decide(part: Part, left_s: float, budget_s: float) -> tuple[Optional[int], str]:
    """(time limit, "") to run `part` with `left_s` seconds of the run's budget left, or
    (None, reason) to skip it."""
    if left_s < max(MIN_PART_S, part.estimate_s):
        return None, (f"needs ~{part.estimate_s} s, {max(0, int(left_s))} s of the run's "
                      f"{int(budget_s)} s budget (GPU_CHECK_BUDGET_S) left")
    return int(min(part.limit_s, left_s)), ""


def plan(parts: Iterable[Part], budget_s: float, selected: Optional[set] = None) -> list[dict]:
    """What the run is expected to do if every part takes its estimate: for each part, run (with
    its limit) or skip (with the reason). The script decides again before each part with the time
    actually left (decide), so a fast machine runs more than this, a slow one less."""
    left, rows = float(budget_s), []
    for part in parts:
        if selected is not None and part.name not in selected:
            rows.append({"part": part.name, "run": False, "limit_s": None,
                         "reason": "not in GPU_CHECK_PARTS"})
            continue
        limit, reason = decide(part, left, budget_s)
        rows.append({"part": part.name, "run": limit is not None, "limit_s": limit, "reason": reason})
        if limit is not None:
            left -= part.estimate_s
    return rows


# -- resume ----------------------------------------------------------------------------------------

def read_losses(lines: Iterable[str]) -> dict[int, float]:
    """{step: loss} of a metrics.jsonl (training/metrics.py: one flat object per logged step;
    validation records carry no "loss")."""
    losses = {}
    for line in lines:
        if line.strip():
            record = json.loads(line)
            if "loss" in record and "step" in record:
                losses[int(record["step"])] = float(record["loss"])
    return losses


def compare_resumed(uninterrupted: dict[int, float], resumed: dict[int, float], from_step: int,
                    rtol: float, exact_steps: int) -> tuple[bool, str]:
    """Did the run resumed from the checkpoint of `from_step` give the uninterrupted run's losses?

    The first `exact_steps` steps after the checkpoint must be bitwise equal: their forward reads
    only what the checkpoint restored (weights, data position, RNG), and forward kernels are
    deterministic. Later steps may differ by `rtol` (relative): on a GPU, atomics in a backward
    (embedding gradients, mem-efficient attention) add in another order from run to run; on CPU
    pass rtol=0. A resume that lost the optimizer state, the data position or the schedule
    changes the loss far more than that."""
    expected = sorted(s for s in uninterrupted if s > from_step)
    if not expected:
        return False, f"the uninterrupted run logged no step after {from_step}"
    missing = [s for s in expected if s not in resumed]
    if missing:
        return False, f"the resumed run logged no loss for steps {missing}"
    extra = sorted(s for s in resumed if s <= from_step)
    if extra:
        return False, f"the resumed run trained steps {extra} again (did it load the step-{from_step} checkpoint?)"
    worst, lines = 0.0, []
    for i, step in enumerate(expected):
        a, b = uninterrupted[step], resumed[step]
        if not (math.isfinite(a) and math.isfinite(b)):
            return False, f"step {step}: loss {a} uninterrupted, {b} resumed"
        rel = abs(a - b) / max(abs(a), 1e-12)
        allowed = 0.0 if i < exact_steps else rtol
        if rel > allowed:
            return False, (f"step {step}: loss {b!r} resumed vs {a!r} uninterrupted (relative "
                           f"difference {rel:.2e}, allowed {allowed:g})")
        worst = max(worst, rel)
        lines.append(f"{step}: {b:.6f}")
    return True, (f"steps {expected[0]}-{expected[-1]} from the step-{from_step} checkpoint: losses "
                  f"{', '.join(lines)}, equal to the uninterrupted run's (largest relative difference "
                  f"{worst:.1e}; first {exact_steps} bitwise)")


def step_dir(run_dir: Path, step: int) -> Path:
    """A checkpoint's folder (training/checkpoint.py step_dir_name: step_ and 7 digits)."""
    return run_dir / "checkpoints" / f"step_{step:07d}"


def resume_demo(demo: Path, into: Path, from_step: int, rtol: float, exact_steps: int,
                train: list[str], layout: str = "dp_reshardable") -> tuple[bool, str]:
    """Resume `demo`'s step-`from_step` checkpoint in a fresh run.dir `into` (only that
    checkpoint copied over, so the trainer's run.resume=auto takes it: its loader goes through
    training/safe_load.py), run `train` (python train.py ... run.dir=into run.resume=auto), and
    compare its losses with the ones `demo` logged after that step. The checkpoint's manifest
    must give the optimizer state `layout` (training/checkpoint.py writes "optimizer_layout")."""
    source = step_dir(demo, from_step)
    if not source.is_dir():
        found = sorted(p.name for p in (demo / "checkpoints").glob("step_*")) if demo.is_dir() else []
        return False, f"{source} does not exist (checkpoints there: {found or 'none'}); did demo_bf16 run?"
    try:
        saved = json.loads((source / "manifest.json").read_text()).get("optimizer_layout")
    except (OSError, ValueError) as exc:
        return False, f"cannot read {source / 'manifest.json'}: {exc}"
    if saved != layout:
        return False, f"the checkpoint holds the optimizer state in layout {saved!r}, not {layout!r}"
    shutil.rmtree(into, ignore_errors=True)
    shutil.copytree(source, step_dir(into, from_step), symlinks=True)
    proc = subprocess.run(train, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(proc.stdout, end="")
    if proc.returncode != 0:
        return False, f"the resumed run exited {proc.returncode}"
    # the console may wrap a long path: compare without whitespace, in the output and train.log
    said = "".join(proc.stdout.split())
    if (into / "train.log").exists():
        said += "".join((into / "train.log").read_text(errors="replace").split())
    if "".join(f"resumed from {step_dir(into, from_step)}".split()) not in said:
        return False, "the resumed run did not say `resumed from` the copied checkpoint"
    try:
        a = read_losses((demo / "metrics.jsonl").read_text().splitlines())
        b = read_losses((into / "metrics.jsonl").read_text().splitlines())
    except (OSError, ValueError) as exc:
        return False, f"cannot read the metrics: {exc}"
    ok, line = compare_resumed(a, b, from_step, rtol, exact_steps)
    return ok, (f"{line}; optimizer state {layout}" if ok else line)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    pp = sub.add_parser("plan")
    pp.add_argument("--mode", choices=PARTS, required=True)
    pp.add_argument("--budget", type=float)
    pp.add_argument("--parts", help="comma list (GPU_CHECK_PARTS)")
    pd = sub.add_parser("decide")
    pd.add_argument("--mode", choices=PARTS, required=True)
    pd.add_argument("--part", required=True)
    pd.add_argument("--left", type=float, required=True)
    pd.add_argument("--budget", type=float)
    pr = sub.add_parser("resume")
    pr.add_argument("--demo", type=Path, required=True, help="the uninterrupted run's run.dir")
    pr.add_argument("--into", type=Path, required=True, help="run.dir of the resumed run (replaced)")
    pr.add_argument("--from-step", type=int, required=True)
    pr.add_argument("--rtol", type=float, required=True)
    pr.add_argument("--exact-steps", type=int, default=1)
    pr.add_argument("train", nargs=argparse.REMAINDER, help="-- then the resumed run's command")
    args = p.parse_args(argv)
    if args.command == "plan":
        budget = args.budget or BUDGET_S[args.mode]
        selected = set(args.parts.split(",")) if args.parts else None
        for row in plan(PARTS[args.mode], budget, selected):
            print(f"{row['part']}: " + (f"runs (limit {row['limit_s']} s)" if row["run"]
                                        else f"skipped: {row['reason']}"))
        return ExitCode.OK
    if args.command == "decide":
        limit, reason = decide(part_named(args.mode, args.part), args.left,
                               args.budget or BUDGET_S[args.mode])
        print(f"run {limit}" if limit is not None else f"skip {reason}")
        return ExitCode.OK
    train = args.train[1:] if args.train[:1] == ["--"] else args.train
    if not step_dir(args.demo, args.from_step).is_dir():  # demo_bf16 was skipped, or its row failed
        print(f"skipped: no step-{args.from_step} checkpoint of demo_bf16 to resume "
              f"({args.demo}); demo_bf16's own row says why")
        return ExitCode.SKIPPED
    ok, line = resume_demo(args.demo, args.into, args.from_step, args.rtol, args.exact_steps, train)
    print(f"resume: {'ok' if ok else 'FAILED'}: {line}")
    return ExitCode.OK if ok else ExitCode.CHECK_FAILED


if __name__ == "__main__":
    sys.exit(main())

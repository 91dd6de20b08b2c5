"""Golden losses: the per-step training losses of a short deterministic run, kept in tests/golden/.

    python -m studies.golden                 # show what is stored (changes nothing)
    python -m studies.golden --regenerate    # re-run and rewrite tests/golden/{bf16,nvfp4,mxfp8}.json
    python -m studies.golden --regenerate --precisions mxfp8   # only those (comma list)

tests/system/test_golden_losses.py re-runs the same command and compares. Regenerate only on purpose (a change
that is meant to change the numerics), and say why in the commit. Each file records what made it
(torch, CPU kernel level, and `gemm_compute`: whether BF16 GEMMs multiplied in BF16 or, on a CPU
without BF16 instructions, in FP32); the test compares exactly only on the same three, so
regenerating a file on another kind of machine moves its exact comparison there: `--precisions`
adds or refreshes one format without rewriting the others.

Determinism: one torch thread (OMP_NUM_THREADS=1), so the summation order of the CPU kernels does
not depend on the machine's core count; a fixed seed for the initial weights, the data order and
the stochastic-rounding draws; the demo corpus's texts are a snapshot in the repository
(data/demo_corpus/, CPython 3.11.7's), the same on every Python version. What the run trains on is
recorded as the corpus key (a hash of those texts, the settings and the `tokenizers` version) and
as `corpus_tokens_sha256`, a hash of the token ids themselves: another `tokenizers` version changes
the key, but the losses are comparable as long as it trains the same BPE, i.e. the tokens match.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from omegaconf import OmegaConf

from benchmarks.machine import machine_summary
from data.config import DEMO_DATASETS
from data.demo import ensure_demo_corpus
from data.indexed import open_indexed
from errors import ConfigError, ExitCode
from model.device import probe_hardware
from training.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
GOLDEN_DIR = REPO / "tests" / "golden"
PRECISIONS = ["bf16", "nvfp4", "mxfp8"]
# The run: recipes/experiment/golden.yaml (the test-sized trainer, 8 steps, no evaluation, one
# checkpoint at the end) under each precision.
RECIPE = REPO / "recipes" / "experiment" / "golden.yaml"
STEPS = OmegaConf.load(RECIPE).trainer.max_steps
THREADS = 1
ENV = {"OMP_NUM_THREADS": str(THREADS), "MKL_NUM_THREADS": str(THREADS), "PYTHONUNBUFFERED": "1"}
# Another torch build (or BLAS / CPU ISA) sums in another order: ~1e-7 relative per GEMM, which
# training amplifies step by step, and under NVFP4 a value that moves across a rounding threshold
# changes a whole quantized element. Stand-in measured for "another summation order": the same
# build with 2 threads instead of 1 moved the 8 losses by at most 1.7e-4 (bf16), 2.7e-3 (nvfp4)
# and 6.8e-4 (mxfp8; measured on the Intel Xeon without BF16 instructions, FP32 GEMMs, that made
# mxfp8.json). The tolerances (absolute, per step) are ~10x those.
TOLERANCE = {"bf16": 2e-3, "nvfp4": 2e-2, "mxfp8": 7e-3}
TOLERANCE_BASIS = {"bf16": "1 vs 2 torch threads, same build: max |diff| 1.7e-4",
                   "nvfp4": "1 vs 2 torch threads, same build: max |diff| 2.7e-3",
                   "mxfp8": "1 vs 2 torch threads, same build (FP32 GEMMs): max |diff| 6.8e-4"}


def gemm_compute_here() -> str:
    """What BF16 GEMMs compute in on this CPU by default: "bf16" or "fp32" (model/device.py)."""
    import torch

    return "fp32" if probe_hardware("cpu").gemm_compute().dtype == torch.float32 else "bf16"


def overrides(precision: str) -> list[str]:
    return ["experiment=golden", f"precision={precision}"]


def corpus_tokens_sha256(corpus_path: str) -> str:
    """sha256 over the demo corpus's datasets in order: each one's token ids (its .bin file, ids
    with an end-of-document after each document) and its document lengths. Equal digests: the
    runs train and validate on the same tokens, whatever built them."""
    import hashlib

    import numpy as np

    h = hashlib.sha256()
    for name in DEMO_DATASETS:
        h.update(name.encode() + b"\0")
        with open(os.path.join(corpus_path, name + ".bin"), "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        dataset = open_indexed(os.path.join(corpus_path, name))  # held: its lengths view its mmap
        h.update(np.asarray(dataset.sequence_lengths, dtype="<i8").tobytes())
    return h.hexdigest()


def losses_of(run_dir: Path) -> list[float]:
    by_step = {rec["step"]: rec["loss"] for rec in read_metrics(run_dir, kind="step")}
    return [by_step[s] for s in sorted(by_step)]


def train(precision: str, run_dir: Path, cache_dir: Path | None = None) -> list[float]:
    env = {**os.environ, **ENV}
    if cache_dir is not None:
        env["NVFP4_CACHE"] = str(cache_dir)
    cmd = [sys.executable, str(REPO / "train.py"), f"run.dir={run_dir}", *overrides(precision)]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise SystemExit(f"{precision}: train.py exited {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return losses_of(run_dir)


# Files made before this field: on the AMD EPYC (AVX512-BF16, no AMX) or with FP32 GEMMs.
DEFAULT_BF16_KERNELS = "avx512_bf16"


def bf16_gemm_kernels() -> str:
    """Which oneDNN kernel family multiplies BF16 on this CPU: "amx" (AMX tiles), "avx512_bf16"
    or "none" (no BF16 instructions: FP32 GEMMs). Both report torch's cpu_capability AVX512,
    but they sum in another order: the golden losses are exact within one family only (an
    Intel Xeon with AMX moved the bf16 file's step 1 by 7.6e-5, 2026-12-03)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "none"
    if "amx_bf16" in flags:
        return "amx"
    return "avx512_bf16" if "avx512_bf16" in flags else "none"


def made_on(gemm_compute: str, machine: str) -> str:
    """The golden file's plain statement of what made it (gemm_compute as gemm_compute_here())."""
    how = ("BF16 GEMMs multiplied in BF16 (native BF16 instructions)" if gemm_compute == "bf16"
           else "BF16 GEMMs multiplied in FP32 (no BF16 instructions on this CPU; "
                "nvfp4_recipe/compute.py)")
    return f"{machine}: {how}"


def parse_precisions(text: str | None) -> list[str]:
    """--precisions: a comma list of PRECISIONS (None: all of them); ConfigError (exit 2) naming
    a bad one."""
    if text is None:
        return list(PRECISIONS)
    chosen = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in chosen if p not in PRECISIONS]
    if bad or not chosen:
        raise ConfigError(f"--precisions={text!r}: choose from {', '.join(PRECISIONS)} "
                          f"(comma-separated)")
    return list(dict.fromkeys(chosen))


def regenerate(precisions: list[str] = PRECISIONS) -> None:
    import tokenizers
    import torch

    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        # the corpus the runs below train on (they find it in this cache)
        corpus = ensure_demo_corpus(str(Path(tmp) / "cache" / "data"))
        key, tokens = corpus.key, corpus_tokens_sha256(corpus.path)
        for p in precisions:
            t0 = time.time()
            losses = train(p, Path(tmp) / p, cache_dir=Path(tmp) / "cache")
            record = {
                "precision": p, "losses": losses, "steps": STEPS,
                "command": "OMP_NUM_THREADS=1 python train.py run.dir=<tmp> " + " ".join(overrides(p)),
                "overrides": overrides(p), "env": ENV,
                "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                "gemm_compute": gemm_compute_here(), "bf16_gemm_kernels": bf16_gemm_kernels(),
                "made_on": made_on(gemm_compute_here(), machine_summary()),
                "python": platform.python_version(),
                "tokenizers": tokenizers.__version__, "corpus_key": key, "corpus_tokens_sha256": tokens,
                "machine": machine_summary(), "generated": datetime.now(timezone.utc).isoformat(),
                "tolerance_other_builds": TOLERANCE[p], "tolerance_basis": TOLERANCE_BASIS[p],
                "note": "regenerate with `python -m studies.golden --regenerate`; compared by "
                        "tests/system/test_golden_losses.py: on the same corpus tokens "
                        "(corpus_tokens_sha256), "
                        "exactly when torch, cpu_capability, gemm_compute and (for BF16 GEMMs) "
                        "bf16_gemm_kernels match, else within "
                        "tolerance_other_builds (absolute, per step)",
            }
            (GOLDEN_DIR / f"{p}.json").write_text(json.dumps(record, indent=1) + "\n")
            print(f"{p}: {len(losses)} losses, {losses[0]:.6f} -> {losses[-1]:.6f} "
                  f"({time.time() - t0:.0f} s) -> {GOLDEN_DIR / (p + '.json')}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m studies.golden", description=__doc__.split("\n")[0])
    ap.add_argument("--regenerate", action="store_true",
                    help="re-run and overwrite tests/golden/*.json (on purpose only)")
    ap.add_argument("--precisions", default=None, metavar="LIST",
                    help=f"comma list of the precisions to show or regenerate (default: "
                         f"{','.join(PRECISIONS)}); the others' files are left as they are")
    args = ap.parse_args(argv)
    try:
        precisions = parse_precisions(args.precisions)
    except ConfigError as error:  # before anything runs or is written
        print(f"error: {error}", file=sys.stderr)
        return error.code
    if not args.regenerate:
        for p in precisions:
            f = GOLDEN_DIR / f"{p}.json"
            if f.exists():
                g = json.loads(f.read_text())
                print(f"{f.relative_to(REPO)}: torch {g['torch']}, {len(g['losses'])} steps, "
                      f"final loss {g['losses'][-1]:.6f}, generated {g['generated']}")
        print("refusing to overwrite the golden files without --regenerate", file=sys.stderr)
        return ExitCode.CONFIG
    regenerate(precisions)
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())

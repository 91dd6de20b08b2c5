"""mamba_ssm's Triton SSD scan against the PyTorch scan the Mamba mixer falls back to.

`python -m model.ssd_check [--json PATH] [--autotune]` runs the comparison on CUDA (part
`ssd_triton` of launch/gpu_check.sh); tests/nvfp4_recipe/test_cuda_numerics.py asserts the same numbers.
Exit status (errors.ExitCode): 0 within tolerance, 10 beyond it, 77 skipped (the reason is
printed), 1 an error.

What is compared: ``mamba_chunk_scan_combined`` called exactly as model/mamba_mixer.py calls it
(D, dt_bias, dt_softplus=True, no z) and ``model.ssd.ssd_chunk_scan`` on the same random inputs,
forward and backward, in FP32 and BF16, each against a float64 run of the PyTorch scan on the
same (dtype-rounded) inputs. Error = relative L2 norm of the difference, per output/gradient.

Tolerances (relative L2): FP32 5e-3: Triton's ``tl.dot`` takes FP32 operands as TF32 on Ampere
and later (10-bit mantissa, unit roundoff 2^-11 = 4.9e-4), and the SSD kernels issue their dots
without asking otherwise (mamba 2.3.2.post1 ops/triton/ssd_chunk_scan.py:118-150,
ssd_bmm.py:78); a few such roundings per term give ~1e-3. BF16 3e-2: the kernels round the
chunk states and the decayed C.B scores to the input dtype before their dots
(ssd_chunk_scan.py:117, :148; 2^-9 = 2e-3 each), and y and the gradients are BF16. A wrong
decay, state hand-over or padding gives errors of order 1 (tests/launch/test_gpu_check.py).

Loading without the CUDA extension: as the trainer's mixer does (model/mamba_mixer.py), through
``compat.mamba_ssm_triton_kernels``: a normal import, else the Triton modules loaded without
mamba_ssm's package ``__init__``, whose import fails in a wheel built with
MAMBA_SKIP_CUDA_BUILD=TRUE (`make gpu-wheels`: no ``selective_scan_cuda``; compat.py item 8). The
report says which way the kernel was loaded.

Compile time: each SSD kernel is autotuned over up to ~10 configs, forward and backward, per
dtype (minutes of Triton JIT on a cold machine). Unless ``--autotune``, the kernels are loaded
with MAMBA_DETERMINISTIC=1, which makes mamba keep only the cheapest config of each
(utils/determinism.py:59-77, applied when the kernels are decorated, i.e. at import); the
variable is restored before any call, so the forward and backward run mamba's default
(non-deterministic) code, with fixed tile sizes.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

import compat
from errors import ExitCode
from model.device import cuda_present
from model.ssd import ssd_chunk_scan

TOLERANCE = {torch.float32: 5e-3, torch.bfloat16: 3e-2}  # relative L2; reasons in the docstring
GRADS = ("x", "dt", "A", "B", "C", "D", "dt_bias")


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    seqlen: int
    nheads: int
    headdim: int
    ngroups: int
    dstate: int
    chunk: int
    dtypes: tuple = (torch.float32, torch.bfloat16)


CASES = (
    # several groups, a sequence that ends in a partial chunk (300 = 2 x 128 + 44)
    Case("4 groups, partial last chunk", 2, 300, 8, 32, 4, 32, 128),
    # the ~1B hybrid's mixer (benchmarks/hardware.py HYBRID_1B): 64 heads x 64, state 128, 8 groups, in
    # the training dtype only (each dtype and shape is another Triton compile)
    Case("hybrid_1b mixer", 1, 1024, 64, 64, 8, 128, 128, (torch.bfloat16,)),
)


@contextlib.contextmanager
def _env(**values: str):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_LOADED: dict = {}


def load_triton_ssd(autotune: bool = False) -> tuple[Optional[Callable], str]:
    """(mamba_chunk_scan_combined, how it was loaded) or (None, why it cannot run here)."""
    if autotune in _LOADED:
        return _LOADED[autotune]
    if not cuda_present():
        result = None, "needs a CUDA device (mamba_ssm's SSD scan is Triton kernels); none visible to torch"
    elif importlib.util.find_spec("triton") is None:
        result = None, "triton is not installed"
    elif importlib.util.find_spec("mamba_ssm") is None:
        result = None, ("mamba_ssm is not installed (`make gpu-wheels` brings it, built without "
                        "its CUDA extension)")
    else:
        env = {} if autotune else {"MAMBA_DETERMINISTIC": "1"}
        how = "autotuned" if autotune else "cheapest config per kernel"
        with _env(**env):
            kernels, _, loaded = compat.mamba_ssm_triton_kernels()
        fn = kernels.get("mamba_chunk_scan_combined")
        result = (fn, f"{loaded}; the trainer's mixer loads it the same way; {how}") if fn else (None, loaded)
    _LOADED[autotune] = result
    return result


def make_inputs(case: Case, seed: int = 0) -> dict:
    """FP32 CPU tensors in the mixer's layout (model/mamba_mixer.py): dt raw as from the in_proj,
    dt_bias = softplus^-1 of a dt in [1e-2, 1e-1], A = -[0.1, 2]. Memories (1 / (dt |A|)) run
    from ~5 steps to longer than a chunk, so the state handed between chunks matters, and D is
    small (0.1 x N(0, 1)), so y is the scan's rather than the D x skip's: a kernel that dropped
    the state passing would be off by ~40-75%."""
    g = torch.Generator().manual_seed(seed)
    b, l, h, p, ng, n = case.batch, case.seqlen, case.nheads, case.headdim, case.ngroups, case.dstate
    dt0 = torch.exp(torch.rand(h, generator=g) * (math.log(0.1) - math.log(0.01)) + math.log(0.01))
    return {
        "x": torch.randn(b, l, h, p, generator=g),
        "dt": torch.randn(b, l, h, generator=g) * 0.5,
        "A": -(0.1 + 1.9 * torch.rand(h, generator=g)),
        "B": torch.randn(b, l, ng, n, generator=g),
        "C": torch.randn(b, l, ng, n, generator=g),
        "D": 0.1 * torch.randn(h, generator=g),
        "dt_bias": dt0 + torch.log(-torch.expm1(-dt0)),
        "dy": torch.randn(b, l, h, p, generator=g),
    }


def _run(scan: Callable, inputs: dict, case: Case, dtype: torch.dtype, device) -> dict:
    """y and the gradients of sum(y * dy); x, dt, B, C in `dtype`, A, D, dt_bias in FP32 (or
    all float64 for the reference), as the mixer passes them."""
    low = {"x", "dt", "B", "C"}
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    leaf = {k: v.to(device, dtype if k in low else wide).detach().clone().requires_grad_()
            for k, v in inputs.items() if k != "dy"}  # fresh leaves: no gradient shared between runs
    y = scan(leaf["x"], leaf["dt"], leaf["A"], leaf["B"], leaf["C"], case.chunk, D=leaf["D"],
             dt_bias=leaf["dt_bias"], dt_softplus=True)
    dy = inputs["dy"].to(device, wide)
    (y.to(dy.dtype) * dy).sum().backward()
    out = {"y": y.detach()}
    out.update({k: leaf[k].grad for k in GRADS})
    return out


def _triton_call(fn: Callable) -> Callable:
    def scan(x, dt, A, B, C, chunk, D, dt_bias, dt_softplus):
        # the call of model/mamba_mixer.py (kernel path): contiguous inputs, z=None
        return fn(x.contiguous(), dt.contiguous(), A, B.contiguous(), C.contiguous(), chunk_size=chunk,
                  D=D, z=None, dt_bias=dt_bias, dt_softplus=dt_softplus)
    return scan


def _pytorch_call(x, dt, A, B, C, chunk, D, dt_bias, dt_softplus):
    return ssd_chunk_scan(x, dt, A, B, C, chunk, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus)


def rel_l2(a: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return float((a.double() - ref).norm() / ref.norm().clamp_min(1e-300))


def compare(triton_scan: Callable, case: Case, dtype: torch.dtype, device="cuda", seed: int = 0) -> dict:
    """Relative L2 errors of the Triton and the PyTorch scans against the float64 PyTorch scan."""
    inputs = make_inputs(case, seed)
    # round the low-precision inputs once, so all three runs see the same values
    inputs = {k: (v.to(dtype).float() if k in ("x", "dt", "B", "C") else v) for k, v in inputs.items()}
    ref = _run(_pytorch_call, inputs, case, torch.float64, device)
    t0 = time.perf_counter()
    tri = _run(_triton_call(triton_scan), inputs, case, dtype, device)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    first_call_s = time.perf_counter() - t0
    pt = _run(_pytorch_call, inputs, case, dtype, device)
    tol = TOLERANCE[dtype]
    errors = {k: {"triton": rel_l2(tri[k], ref[k]), "pytorch": rel_l2(pt[k], ref[k])} for k in ref}
    ok = all(math.isfinite(e["triton"]) and e["triton"] <= tol for e in errors.values())
    shape = {k: v for k, v in asdict(case).items() if k not in ("name", "dtypes")}
    return {"case": case.name, "shape": shape, "dtype": str(dtype).replace("torch.", ""),
            "tolerance": tol, "ok": ok, "errors": errors, "first_call_s": round(first_call_s, 2)}


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="PATH", help="write the results here")
    p.add_argument("--autotune", action="store_true",
                   help="autotune every kernel as mamba does by default (minutes of Triton JIT)")
    args = p.parse_args(argv)
    fn, how = load_triton_ssd(args.autotune)
    results = {"loaded": fn is not None, "how": how, "results": []}
    if fn is None:
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        print(f"skipped: {how}")
        return ExitCode.SKIPPED
    print(f"mamba_chunk_scan_combined: {how}")
    print(f"{'case':<30} {'dtype':<9} {'tol':>7}  worst Triton error (PyTorch scan's)  first call")
    failed = False
    for case in CASES:
        for dtype in case.dtypes:
            try:
                r = compare(fn, case, dtype)
            except Exception as exc:  # a kernel that fails to compile or launch is a failure
                r = {"case": case.name, "dtype": str(dtype), "ok": False,
                     "error": f"{type(exc).__name__}: {exc}"}
                print(f"{case.name:<30} {r['dtype']:<9} ERROR {r['error']}")
            else:
                worst = max(r["errors"], key=lambda k: r["errors"][k]["triton"])
                e = r["errors"][worst]
                print(f"{case.name:<30} {r['dtype']:<9} {r['tolerance']:>7.0e}  {worst:>7} {e['triton']:.2e} "
                      f"({e['pytorch']:.2e})  {r['first_call_s']:.1f} s  "
                      f"{'ok' if r['ok'] else 'BEYOND TOLERANCE'}")
            failed |= not r["ok"]
            results["results"].append(r)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return ExitCode.CHECK_FAILED if failed else ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())

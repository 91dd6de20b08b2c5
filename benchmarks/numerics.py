"""Numerics benchmark: `python -m benchmarks.numerics [--quick] [--background-load N] [--json PATH]`.

Quantize throughput of quantize_nvfp4 (1x16, 16x16, SR; default kernels, and eager) against
torchao's NVFP4Tensor.to_nvfp4
and a plain vectorized reference (TE-reference style: one mask per E2M1 threshold, no chunking),
and emulated nvfp4_linear forward+backward against bf16 F.linear (kernels "auto", i.e. compiled
where inductor can build them, and "eager") and FP32 F.linear; the BF16 and emulated GEMMs compute
as the GEMM compute policy says (`--gemm-compute`, default auto: FP32 on a CPU without BF16
instructions, nvfp4_recipe/compute.py); "direct" is `nvfp4_linear` called as a library user calls
it, outside any context (the library decides its GEMMs' dtype itself). Prints Markdown tables of seconds and ratios; timings
are interleaved medians (see benchmarks/timing.py measure_interleaved).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from model.device import probe_hardware
from nvfp4_recipe.compute import GEMM_COMPUTE, GemmCompute
from nvfp4_recipe.config import NVFP4Config
from nvfp4_recipe.linear import nvfp4_linear
from nvfp4_recipe.nvfp4 import quantize_nvfp4, tensor_scales

from .machine import MachineLoad, background_load, hardware_info
from .timing import format_table, measure_interleaved

FP32_MAX = torch.finfo(torch.float32).max


def plain_reference_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 1x16 in the simplest vectorized form (whole-tensor passes, one mask per threshold)."""
    rows, k = x.shape
    xf = x.float().view(rows, k // 16, 16)
    vec_max = xf.abs().amax(-1, keepdim=True)
    s_enc, s_dec = tensor_scales(vec_max.max())
    scale = torch.clamp(vec_max * (s_enc * torch.tensor(1 / 6, dtype=torch.float32)), max=FP32_MAX)
    scale = scale.clamp(-448, 448).to(torch.float8_e4m3fn)
    encode = torch.clamp(1.0 / (scale.float() * s_dec), max=FP32_MAX)
    v = torch.clamp(xf * encode, -6, 6).view(rows, k)
    a = v.abs()
    code = torch.zeros_like(a, dtype=torch.uint8)
    for threshold, inclusive in ((0.25, True), (0.75, False), (1.25, True), (1.75, False), (2.5, True), (3.5, False), (5.0, True)):
        code += (a > threshold) if inclusive else (a >= threshold)
    code += (v < 0).to(torch.uint8) * 8
    return code[:, 0::2] | (code[:, 1::2] << 4), scale.view(rows, k // 16)


def bench_quantize(size: int, repeats: int) -> list[dict[str, object]]:
    x = torch.randn(size, size, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    ours = quantize_nvfp4(x)
    plain_codes, _ = plain_reference_quantize(x)
    fns = {
        "nvfp4 1x16": lambda: quantize_nvfp4(x),
        "nvfp4 16x16": lambda: quantize_nvfp4(x, tile=(16, 16)),
        "nvfp4 1x16 SR": lambda: quantize_nvfp4(x, rounding="stochastic"),
        "nvfp4 1x16 eager": lambda: quantize_nvfp4(x, kernels="eager"),
        "nvfp4 1x16 SR eager": lambda: quantize_nvfp4(x, rounding="stochastic", kernels="eager"),
        "plain reference 1x16": lambda: plain_reference_quantize(x),
    }
    torchao_note = "torchao not installed"
    try:
        from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

        per_tensor = per_tensor_amax_to_scale(ours.amax)
        theirs = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor)
        torchao_note = f"{int((theirs.qdata.view(torch.uint8) != ours.data).sum())} packed bytes differ (ties)"
        fns["torchao to_nvfp4 1x16"] = lambda: NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor)
    except ImportError:
        pass
    seconds = measure_interleaved(fns, warmup=1, repeats=repeats)
    baseline = seconds.get("torchao to_nvfp4 1x16")
    rows = []
    for name, s in seconds.items():
        rows.append({
            "quantize (bf16)": f"{name} {size}x{size}",
            "ms": s * 1e3,
            "Melem/s": size * size / s / 1e6,
            "speedup vs torchao": baseline / s if baseline else "-",
            "speedup vs plain": seconds["plain reference 1x16"] / s,
        })
    rows.append({"quantize (bf16)": "bit-exact vs plain reference", "ms": str(torch.equal(plain_codes, ours.data))})
    rows.append({"quantize (bf16)": "vs torchao", "ms": torchao_note})
    return rows


def bench_linear(size: int, repeats: int, gemm: GemmCompute) -> dict[str, object]:
    """Forward + backward at T=N=K=size: BF16 F.linear and the emulated NVFP4 linear with their
    GEMMs as `gemm` (the GEMM compute policy) says, and F.linear on FP32 tensors."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(size, size, dtype=torch.bfloat16, generator=gen).requires_grad_()
    w = (torch.randn(size, size, dtype=torch.bfloat16, generator=gen) / size**0.5).requires_grad_()
    dy = torch.randn(size, size, dtype=torch.bfloat16, generator=gen)
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    dy32 = dy.float()

    def step(linear):
        def run():
            x.grad = w.grad = None
            with gemm.context():
                linear(x, w).backward(dy)
        return run

    def fp32_step():
        x32.grad = w32.grad = None
        F.linear(x32, w32).backward(dy32)

    def direct_step():  # as a library user calls it: no context; the library decides the GEMMs
        x.grad = w.grad = None
        nvfp4_linear(x, w).backward(dy)

    fns = {
        "bf16": step(F.linear),
        "fp32": fp32_step,
        "nvfp4 fast": step(lambda a, b: nvfp4_linear(a, b, None, NVFP4Config(kernels="auto"))),
        "nvfp4 fast eager": step(lambda a, b: nvfp4_linear(a, b, None, NVFP4Config(kernels="eager"))),
        "nvfp4 exact": step(lambda a, b: nvfp4_linear(a, b, None, NVFP4Config(gemm="exact"))),
        "nvfp4 direct": direct_step,
    }
    s = measure_interleaved(fns, warmup=1, repeats=repeats)
    return {
        "fwd+bwd T=N=K": size,
        "bf16 F.linear ms": s["bf16"] * 1e3,
        "fp32 F.linear ms": s["fp32"] * 1e3,
        "nvfp4 fast ms": s["nvfp4 fast"] * 1e3,
        "fast / bf16": s["nvfp4 fast"] / s["bf16"],
        "fast / fp32": s["nvfp4 fast"] / s["fp32"],
        "fast eager / bf16": s["nvfp4 fast eager"] / s["bf16"],
        "exact / bf16": s["nvfp4 exact"] / s["bf16"],
        "direct / fp32": s["nvfp4 direct"] / s["fp32"],
    }


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes only (~30 s)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--background-load", type=int, default=0, metavar="N",
                        help="run N single-threaded BF16 matmul processes beside the bench (a busy "
                             "machine); the report says LOADED")
    parser.add_argument("--gemm-compute", choices=GEMM_COMPUTE, default="auto",
                        help="what BF16 GEMMs compute in (default: this CPU's policy)")
    parser.add_argument("--linear-sizes", default=None, metavar="N,N",
                        help="the linear fwd+bwd sizes only (e.g. 2048), skipping the quantize rows")
    parser.add_argument("--quant-sizes", default=None, metavar="N,N",
                        help="the quantize sizes only (e.g. 4096), skipping the linear rows")
    parser.add_argument("--repeats", type=int, default=3,
                        help="interleaved rounds of the quantize rows (the linear rows: 2N+1)")
    args = parser.parse_args(argv)
    if args.background_load < 0:
        parser.error(f"--background-load must be >= 0, got {args.background_load}")
    quant_sizes = [1024] if args.quick else [2048, 4096]
    linear_sizes = [512, 1024] if args.quick else [1024, 2048, 4096]
    if args.linear_sizes:
        try:
            linear_sizes = [int(n) for n in args.linear_sizes.split(",")]
        except ValueError:
            parser.error(f"--linear-sizes={args.linear_sizes!r}: comma-separated integers")
        quant_sizes = []
    if args.quant_sizes:
        try:
            quant_sizes = [int(n) for n in args.quant_sizes.split(",")]
        except ValueError:
            parser.error(f"--quant-sizes={args.quant_sizes!r}: comma-separated integers")
        linear_sizes = []
    repeats = max(1, args.repeats)
    info = hardware_info()
    gemm = probe_hardware("cpu").gemm_compute(args.gemm_compute)
    info["gemm_compute"] = gemm.describe()
    print("hardware:", ", ".join(f"{k}={v}" for k, v in info.items()))
    with background_load(args.background_load), MachineLoad() as load:
        quant_rows = [row for size in quant_sizes for row in bench_quantize(size, repeats)]
        if quant_rows:
            print(format_table(quant_rows, ["quantize (bf16)", "ms", "Melem/s", "speedup vs torchao",
                                            "speedup vs plain"]))
        linear_rows = [bench_linear(size, 2 * repeats + 1, gemm) for size in linear_sizes]
        if linear_rows:
            print(format_table(linear_rows, list(linear_rows[0])))
    print(f"machine: {load.report.line()}")
    results = {"hardware": info, "background_load": args.background_load, "load": load.report.to_json(),
               "quantize": quant_rows, "linear": linear_rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()

"""What the GPU path actually runs, measured on the device (part `gpu_path` of launch/gpu_check.sh).

    python -m launch.gpu_path_check [--json PATH] [--sections sync,sdpa,scan,grad_norm]

Exit status: 0 when every section passed, 1 when one failed, 77 skipped without CUDA (the reason
printed last). Each section prints one verdict line and adds its numbers to the JSON (issue 26):

- sync (item 1): the demo model, emulated NVFP4 (compiled quantizers), megatron's DDP, optimizer
  and schedule (training/ddp_optimizer.py, training/schedules.py), two warm-up steps, then one
  step with diagnostics on under `torch.cuda.set_sync_debug_mode("warn")`. Every synchronizing
  call is counted by the Python line that made it. FAILS if one comes from this project's per
  micro-batch code (nvfp4_recipe/, model/, training/schedules.py); the rest (megatron's schedule
  and optimizer, the controller's one read of the diagnostics) are listed with their counts.
  Then the emulated linear alone, forward and backward, under mode "error": it must not raise.
- sdpa (item 2): the portable attention (model/attention.py) in BF16 with grouped heads at seq
  4096: which SDPA kernels the profiler saw, whether flash / cuDNN accept `enable_gqa` here, and
  its time against the previous FP32 + repeat_interleave form. FAILS if only the math fallback ran.
- scan (item 4): which Mamba scan the portable mixer and the TE spec would run here, and the
  build's start-up line (model paths).
- grad_norm (item 7): megatron's grad-norm on ~1.1e9 FP32 elements in 400 tensors (the fallback it
  uses without TE or apex, megatron/core/utils.py:1325-1334 in core_v0.19.0, syncs once per
  tensor: `torch.tensor(list of CUDA norms)`) against `torch._foreach_norm`: milliseconds and
  syncs of each. Informative: a fused path in compat is justified only if this shows.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
import warnings
from pathlib import Path

import torch

from model.device import cuda_present

SKIP_EXIT = 77
REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("sync", "sdpa", "scan", "grad_norm")
OURS_PER_MICRO_BATCH = ("nvfp4_recipe/", "model/", "training/schedules.py")


def _where(filename: str) -> str:
    """A library's file relative to site-packages (a venv may sit inside the repository), this
    project's relative to the repository."""
    path = Path(filename).resolve()
    if "site-packages" in path.parts:
        return "/".join(path.parts[path.parts.index("site-packages") + 1:])
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


class SyncCounter:
    """Counts the synchronizing CUDA calls of a region by the Python line that made them."""

    def __enter__(self):
        self.counts = collections.Counter()
        self._catch = warnings.catch_warnings(record=True)
        self.records = self._catch.__enter__()
        warnings.simplefilter("always")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(*exc)
        for w in self.records:
            if "synchronizing" in str(w.message):
                self.counts[f"{_where(w.filename)}:{w.lineno}"] += 1
        return False

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def check_sync(out: dict) -> bool:
    from megatron.core.utils import get_model_config  # noqa: F401  (megatron importable)

    from model.build import build_model
    from model.config import ModelConfig
    from nvfp4_recipe import NVFP4Config, quantized_linear
    from nvfp4_recipe.megatron.controller import PrecisionController
    from nvfp4_recipe.policy import PrecisionConfig
    from training.config import TrainerConfig
    from training.distributed import init_distributed
    from training.ddp_optimizer import PARAMS_DTYPE, build_data_parallel_model, uses_megatron_ddp
    from training.schedules import run_micro_batches

    from compat import seed_model_parallel_rng

    ctx = init_distributed(1, 1, "nccl")
    seed_model_parallel_rng(0, cuda=True)
    precision = PrecisionConfig(name="nvfp4", format="nvfp4")
    built = build_model(ModelConfig(vocab_size=256), precision, vocab_size=256, backend="emulated",
                        params_dtype=PARAMS_DTYPE, cuda=True, main_grads=uses_megatron_ddp(ctx.device))
    core = built.module.to(ctx.device)
    model, optimizer = build_data_parallel_model(core, TrainerConfig(lr=1e-3), ctx)
    controller = PrecisionController(precision, built, 4 * 256, 100 * 4 * 256)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (4, 257), generator=gen)
    batches = [{"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": torch.ones(2, 256)}
               for t in tokens.split(2)]

    def step(i: int, diagnostics: bool = False):
        controller.before_step(i)
        built.runtime_state.collect_diagnostics = diagnostics
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = run_micro_batches(model, batches, ctx, (256, 2, core.config.hidden_size))
        metrics = controller.after_step(i)
        optimizer.step()
        return loss, metrics

    for i in range(2):
        step(i)
    with SyncCounter() as counter:
        _, metrics = step(2, diagnostics=True)
    ours = {k: v for k, v in counter.counts.items() if k.startswith(OURS_PER_MICRO_BATCH)}
    out["sync"] = {"step_syncs": counter.total, "by_line": dict(counter.counts.most_common()),
                   "ours_per_micro_batch": ours, "diagnostics_read": len(metrics),
                   "model_paths": built.paths}
    # The emulated linear alone: no sync at all (set_sync_debug_mode("error") raises on one).
    x = torch.randn(4, 256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(384, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    quantized_linear(x, w, None, NVFP4Config()).float().sum().backward()  # compile / warm up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        quantized_linear(x, w, None, NVFP4Config()).float().sum().backward()
        strict = "ok"
    except RuntimeError as exc:
        strict = f"raised: {exc}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out["sync"]["emulated_linear_error_mode"] = strict
    ok = not ours and strict == "ok"
    print(f"sync: {'ok' if ok else 'FAILED'}: {counter.total} synchronizing calls in a 2-micro-batch "
          f"step with diagnostics ({len(ours)} lines of ours per micro-batch: {ours or 'none'}); "
          f"emulated linear under mode error: {strict}; top: {counter.counts.most_common(4)}")
    return ok


def check_sdpa(out: dict) -> bool:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    seq, batch, heads, groups, dim = 4096, 1, 32, 8, 128
    q = torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(batch, groups, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)

    def new():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).float().sum().backward()

    def old():  # model/attention.py before issue 26: FP32 copies, K/V heads repeated
        kk, vv = (t.float().repeat_interleave(heads // groups, 1) for t in (k, v))
        F.scaled_dot_product_attention(q.float(), kk, vv, is_causal=True).sum().backward()

    accepted = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with sdpa_kernel([backend]):
                new()
            accepted[name] = "ok"
        except RuntimeError as exc:
            accepted[name] = " ".join(str(exc).split())[:160]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        new()
        torch.cuda.synchronize()
    kernels = sorted({e.name for e in prof.events() if any(
        s in e.name.lower() for s in ("flash", "fmha", "cudnn", "attention", "softmax"))})

    def timed(fn, n=5):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n * 1e3

    new_ms, old_ms = timed(new), timed(old)
    fused = any(s in " ".join(kernels).lower() for s in ("flash", "fmha", "cudnn"))
    out["sdpa"] = {"shape": [seq, batch, heads, groups, dim], "accepts_enable_gqa": accepted,
                   "kernels": kernels, "bf16_gqa_ms": round(new_ms, 2), "old_fp32_repeat_ms": round(old_ms, 2)}
    print(f"sdpa: {'ok' if fused else 'FAILED (math fallback)'}: fwd+bwd {new_ms:.1f} ms BF16 + enable_gqa "
          f"vs {old_ms:.1f} ms FP32 + repeat_interleave ({old_ms / new_ms:.2f}x); kernels {kernels[:4]}; "
          f"accepts enable_gqa: {accepted}")
    return fused


def check_scan(out: dict) -> bool:
    from model.backend import probe_machine, select_backend
    from model.device import probe_hardware
    from model.mamba_mixer import mamba_kernels_how
    from nvfp4_recipe.policy import PrecisionConfig

    hardware = probe_hardware("cuda")
    precision = PrecisionConfig(name="nvfp4", format="nvfp4")
    machine = probe_machine(precision, hardware)
    choice = select_backend(precision, "auto", machine)
    how = mamba_kernels_how(cuda=True)
    out["scan"] = {"portable_mixer": how, "auto_choice": choice.reason,
                   "mamba_ssm_package": machine.mamba_ssm, "mamba_triton": machine.mamba_kernels,
                   "causal_conv1d": machine.causal_conv1d}
    print(f"scan: ok: portable mixer: {how}; auto: {choice.reason}")
    return True


def check_grad_norm(out: dict) -> bool:
    from megatron.core.optimizer import clip_grads

    from training.distributed import init_distributed

    init_distributed(1, 1, "nccl")  # get_grad_norm_fp32 all-reduces over its group
    gen = torch.Generator(device="cuda").manual_seed(0)
    # ~1.1e9 FP32 elements in 400 tensors: a ~1B model's main grads, one view per parameter
    sizes = [4096 * 4096] * 60 + [4096 * 128] * 180 + [4096] * 160
    grads = [torch.randn(n, device="cuda", generator=gen) for n in sizes]

    def megatron():
        return clip_grads.get_grad_norm_fp32(grads)  # ends in .item(): a float

    def foreach():
        return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))))

    results = {}
    for name, fn in (("megatron", megatron), ("foreach_norm", foreach)):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            value = fn()
        ms = (time.perf_counter() - t0) / 3 * 1e3
        with SyncCounter() as counter:
            fn()
        results[name] = {"ms": round(ms, 2), "syncs": counter.total, "value": value}
    impl = getattr(clip_grads, "l2_norm_impl", None)
    results["l2_norm_impl"] = f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__name__', impl)}"
    out["grad_norm"] = results
    m, f = results["megatron"], results["foreach_norm"]
    print(f"grad_norm: ok: megatron ({results['l2_norm_impl']}) {m['ms']:.1f} ms, {m['syncs']} syncs; "
          f"torch._foreach_norm {f['ms']:.1f} ms, {f['syncs']} syncs ({len(grads)} tensors, "
          f"{sum(sizes):.2e} elements)")
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--sections", default=",".join(SECTIONS))
    args = p.parse_args(argv)
    if not cuda_present():
        print("skipped: needs a CUDA device; none visible to torch")
        return SKIP_EXIT
    out, ok = {}, True
    checks = {"sync": check_sync, "sdpa": check_sdpa, "scan": check_scan, "grad_norm": check_grad_norm}
    for name in args.sections.split(","):
        try:
            ok &= checks[name](out)
        except Exception as exc:  # a section that cannot run is a failure, the others still run
            ok = False
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"{name}: FAILED ({type(exc).__name__}: {exc})")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    from compat import quiet_cpu_fallback_warnings

    quiet_cpu_fallback_warnings()
    sys.exit(main())

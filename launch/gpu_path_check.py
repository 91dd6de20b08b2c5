"""What the GPU path actually runs, measured on the device (parts `gpu_path` and `gpu_sync` of
launch/gpu_check.sh).

    python -m launch.gpu_path_check [--json PATH] [--sections sdpa,scan,grad_norm,sync]

Exit status (errors.ExitCode): 0 when every section passed, 10 when one failed, 77 skipped
without CUDA (the reason printed last). Each section prints one verdict line and adds its numbers to the JSON. The
verdicts are pure functions of what was recorded, tested on CPU (tests/launch/test_gpu_check.py).
Sections run in the order given; the script runs sdpa, scan, grad_norm first (no compiles), sync
in a part of its own after the compile warm-up.

- sdpa: `SDPACoreAttention` itself (model/attention.py), forward and backward, on the
  q/k/v megatron cuts from its fused QKV (k and v strided views), at the demo's shape (8 heads, 2 groups,
  head dim 32) and the 12B's (40 heads, 8 groups, head dim 128), in BF16 under each backend alone
  (cuDNN, flash, mem-efficient, math) against math in FP32 on the same values. Records which
  backend torch picks unforced and why a backend refuses. FAILS if an accepted backend's output
  or input gradient is off by more than the tolerance (sdpa_verdict), or if torch's own pick is
  the math fallback.
- scan: which Mamba scan the portable mixer and the TE spec would run here, and the build's
  start-up line (model paths).
- grad_norm: megatron's grad-norm on ~1.1e9 FP32 elements in 400 tensors (the fallback it uses
  without TE or apex, megatron/core/utils.py:1325-1334 in core_v0.19.0, syncs once per tensor:
  `torch.tensor(list of CUDA norms)`) against `torch._foreach_norm`: milliseconds and syncs of
  each. Informative: a fused path in compat is justified only if this shows.
- sync: the demo model, emulated NVFP4 (compiled quantizers),
  megatron's DDP, optimizer and schedule (training/ddp_optimizer.py, training/schedules.py),
  warmed up, then a 1-micro-batch and a 2-micro-batch step, both with diagnostics on, under
  `torch.cuda.set_sync_debug_mode("warn")`. The synchronizing calls per micro-batch are what the
  second step makes beyond the first, by line (per_micro_batch_syncs): per-step reads (the
  controller's one read of the diagnostics, training/precision.py `.tolist()`,
  the optimizer's) are the same in both and drop out. FAILS if one per micro-batch comes from
  this project's code. Then the emulated linear alone, forward and backward, under mode
  "error": it must not raise.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Optional

import torch

from compat import seed_model_parallel_rng
from errors import ExitCode
from model.config import ModelConfig
from model.device import cuda_present, probe_hardware
from nvfp4_recipe import NVFP4Config, quantized_linear
from nvfp4_recipe.policy import PrecisionConfig
from training.ddp_optimizer import PARAMS_DTYPE, build_data_parallel_model, uses_megatron_ddp
from training.distributed import init_distributed
from training.schedules import run_micro_batches

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("sdpa", "scan", "grad_norm", "sync")
# This project's code, as _where names it: a synchronizing call from here once per micro-batch fails.
OURS = ("nvfp4_recipe/", "model/", "training/", "data/", "compat.py")
SYNC_MESSAGE = "synchronizing"  # torch's set_sync_debug_mode("warn") text: "called a synchronizing CUDA operation"


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


def innermost_of_ours(stack) -> Optional[tuple[str, int]]:
    """(filename, line) of the innermost frame of this project's code in `stack` ((filename,
    line) pairs, outermost first), or None. torch raises its sync warning at the innermost
    Python frame (`PyErr_WarnEx(..., 1)` in torch/csrc/Exceptions.cpp), which is torch's or
    megatron's own wrapper when our code syncs through one: the sync is ours all the same."""
    for filename, line in reversed(list(stack)):
        if _where(filename).startswith(OURS):
            return filename, line
    return None


def sync_lines(records) -> collections.Counter:
    """{file:line: count} of the synchronizing-call warnings among `records` (warning records:
    .message, .filename, .lineno), files named by _where."""
    counts = collections.Counter()
    for w in records:
        if SYNC_MESSAGE in str(w.message):
            counts[f"{_where(w.filename)}:{w.lineno}"] += 1
    return counts


def per_micro_batch_syncs(one_micro_batch, two_micro_batches) -> dict[str, int]:
    """{file:line: extra syncs} that a 2-micro-batch step makes beyond a 1-micro-batch step of the
    same model and settings: the syncs made once per micro-batch. A read made once per step
    (diagnostics, optimizer, grad norm) occurs in both and cancels, however many there are."""
    one, two = sync_lines(one_micro_batch), sync_lines(two_micro_batches)
    return {line: two[line] - one[line] for line in sorted(two) if two[line] > one[line]}


def ours(lines: dict[str, int]) -> dict[str, int]:
    return {line: n for line, n in lines.items() if line.startswith(OURS)}


# The read the step must make once with diagnostics on: it proves the recording worked.
PER_STEP_READ = "training/precision.py:"


def sync_verdict(one_micro_batch, two_micro_batches) -> tuple[bool, dict, dict, str]:
    """(passed, syncs per micro-batch by line, those of ours, problem) from the warning records of
    a 1- and a 2-micro-batch step, both with diagnostics on. Fails on a sync of ours per
    micro-batch, and when either step shows no read of the diagnostics: then nothing was
    recorded (sync debug mode off, warnings filtered) and "none of ours" would prove nothing."""
    extra = per_micro_batch_syncs(one_micro_batch, two_micro_batches)
    mine = ours(extra)
    if not all(any(line.startswith(PER_STEP_READ) for line in sync_lines(records))
               for records in (one_micro_batch, two_micro_batches)):
        return False, extra, mine, "the controller's read of the diagnostics was not recorded in both steps"
    if mine:
        return False, extra, mine, f"{sum(mine.values())} per micro-batch from this project's code"
    return True, extra, mine, ""


@contextlib.contextmanager
def warnings_at_our_frames():
    """Every warning of the region, recorded (a list of warnings.WarningMessage) at the innermost
    frame of our code that led to it, where there is one (innermost_of_ours)."""
    records = []

    def record(message, category, filename, lineno, file=None, line=None):
        stack = [(f.filename, f.lineno) for f in traceback.extract_stack()[:-1]]
        filename, lineno = innermost_of_ours(stack) or (filename, lineno)
        records.append(warnings.WarningMessage(message, category, filename, lineno))

    with warnings.catch_warnings():  # restores the filters and showwarning on exit
        warnings.simplefilter("always")
        warnings.showwarning = record
        yield records


class SyncCounter:
    """Records the synchronizing CUDA calls of a region (warning records, and their count by
    line), each placed at the innermost frame of our code that led to it."""

    def __enter__(self):
        self._catch = warnings_at_our_frames()
        self.records = self._catch.__enter__()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(*exc)
        self.counts = sync_lines(self.records)
        return False

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def check_sync(out: dict) -> bool:
    from megatron.core.utils import get_model_config  # noqa: F401  (megatron importable)

    # deferred: each needs megatron or hydra, which a bare GPU machine may lack: a section whose
    # imports fail fails alone (main), the others still run
    from model.build import build_model
    from training.config import TrainerConfig
    from training.precision import PrecisionController

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

    def step(i: int, micro_batches: int, diagnostics: bool = True):
        controller.before_step(i)
        built.runtime_state.collect_diagnostics = diagnostics
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = run_micro_batches(model, batches[:micro_batches], ctx, (256, 2, core.config.hidden_size))
        metrics = controller.after_step(i)
        optimizer.step()
        return loss, metrics

    # warm-up: both step shapes, with and without diagnostics, compiled before anything is counted
    for i, (n, diagnostics) in enumerate([(2, False), (1, True), (2, True)]):
        step(i, n, diagnostics)
    with SyncCounter() as one:
        _, metrics = step(3, 1)
    with SyncCounter() as two:
        step(4, 2)
    passed, extra, mine, problem = sync_verdict(one.records, two.records)
    out["sync"] = {"one_micro_batch": {"syncs": one.total, "by_line": dict(one.counts.most_common())},
                   "two_micro_batches": {"syncs": two.total, "by_line": dict(two.counts.most_common())},
                   "per_micro_batch": extra, "ours_per_micro_batch": mine,
                   "diagnostics_read": len(metrics), "model_paths": built.paths}
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
    ok = passed and strict == "ok"
    print(f"sync: {'ok' if ok else 'FAILED' + (f' ({problem})' if problem else '')}: per micro-batch {sum(extra.values())} synchronizing calls "
          f"({one.total} in a 1-micro-batch step, {two.total} in a 2-micro-batch step, both with "
          f"diagnostics), of ours: {mine or 'none'}; others: {dict(list(extra.items())[:4]) or 'none'}; "
          f"emulated linear under mode error: {strict}")
    return ok


# -- sdpa ------------------------------------------------------------------------------------------
# (name, seq, batch, heads, groups, head dim): the demo's attention (recipes/model/demo.yaml) and
# the 12B's (recipes/model/nemotron_h_12b.yaml: 40 heads, 8 groups, kv_channels 128) at seq 4096.
SDPA_SHAPES = (("demo", 256, 4, 8, 2, 32), ("12b", 4096, 1, 40, 8, 128))
SDPA_BACKENDS = ("cudnn", "flash", "efficient", "math")
# What torch chooses, read in pytorch main at 001f694 (after 2.11;
# aten/src/ATen/native/transformers/cuda/sdp_utils.cpp): priority_order puts cuDNN first when
# check_prefer_cudnn_attention holds (runtime cuDNN > 9.15.0 on cc 9.x/10.x); can_use_flash_attention
# takes GQA; can_use_mem_efficient_attention takes GQA there (supports_gqa) but not through 2.11,
# per the reading. Neither is assumed: the check records what this torch does.
# The aten op each backend runs (torch/nn/functional.py dispatches scaled_dot_product_attention
# to one of these; they show as CPU-side op events in the profiler).
SDPA_OPS = {"cudnn": "_scaled_dot_product_cudnn_attention",
            "flash": "_scaled_dot_product_flash_attention",
            "efficient": "_scaled_dot_product_efficient_attention",
            "math": "_scaled_dot_product_attention_math"}
# Relative L2 error of BF16 against the FP32 math reference: BF16 output rounding alone is ~3e-3;
# a fused kernel may be up to SDPA_FACTOR x the BF16 math backend's error, and never needs more
# than SDPA_FLOOR to pass (a wrong mask, scale or head grouping gives errors of order 1).
SDPA_FLOOR, SDPA_FACTOR = 2e-2, 4.0


def backend_from_ops(op_names) -> Optional[str]:
    """The SDPA backend a profiled call ran, from its op names; None if none of them shows."""
    names = " ".join(op_names)
    for backend in ("cudnn", "flash", "efficient", "math"):  # math's op name is no prefix of the others'
        if SDPA_OPS[backend] in names:
            return backend
    return None


def rel_l2(a: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return float((a.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def sdpa_verdict(results: dict, picked: Optional[str]) -> tuple[bool, list[str]]:
    """results: backend -> {"rejected": reason} or {"errors": {tensor: rel. L2 error vs FP32 math}};
    must hold "math" (BF16 math, the baseline). Passes when every accepted backend is within
    max(SDPA_FLOOR, SDPA_FACTOR x math's error) on every tensor, and torch's own pick is fused."""
    problems = []
    baseline = results.get("math", {}).get("errors")
    if not baseline:
        return False, [f"the BF16 math baseline did not run: {results.get('math')}"]
    for backend, r in results.items():
        if "rejected" in r:
            continue
        for tensor, err in r["errors"].items():
            allowed = max(SDPA_FLOOR, SDPA_FACTOR * baseline.get(tensor, 0.0))
            if not err <= allowed:  # NaN fails too
                problems.append(f"{backend} {tensor}: relative error {err:.2e} > {allowed:.2e}")
    if picked is None:
        problems.append("no SDPA op seen in the profile of the unforced call")
    elif picked == "math":
        problems.append("torch picks the math fallback for this layout")
    if all("rejected" in r for b, r in results.items() if b != "math"):
        problems.append("every fused backend rejects this layout")
    return not problems, problems


def _fused_qkv_views(seq, batch, heads, groups, dim, dtype, device, seed=0):
    """(fused buffer, query [s, b, np, hn], key, value [s, b, ng, hn]) cut as megatron's
    SelfAttention.get_query_key_value_tensors does (mc 0.16.1 attention.py:1418-1462: view per group, split,
    reshape): key and value stay strided views of the buffer, the query's reshape copies."""
    gen = torch.Generator(device=device).manual_seed(seed)
    per_group = (heads // groups + 2) * dim
    # the same BF16 values for every dtype, so the FP32 reference differs only in arithmetic
    mixed = torch.randn(seq, batch, groups * per_group, generator=gen, device=device).bfloat16().to(dtype)
    mixed.requires_grad_(True)
    grouped = mixed.view(seq, batch, groups, per_group)
    q, k, v = torch.split(grouped, [heads // groups * dim, dim, dim], dim=3)
    return mixed, q.reshape(seq, batch, heads, dim), k, v


def _attention_module(heads, groups, dim):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from model.attention import SDPACoreAttention  # deferred: megatron, as in check_sync

    config = TransformerConfig(num_layers=1, hidden_size=heads * dim, num_attention_heads=heads,
                               num_query_groups=groups, kv_channels=dim, attention_dropout=0.0,
                               hidden_dropout=0.0)
    return SDPACoreAttention(config, 1, AttnMaskType.causal, "self")


def _run_attention(module, shape, dtype, device, backend=None):
    """(output, grad of the fused QKV, op names seen) of one forward+backward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    _, seq, batch, heads, groups, dim = shape
    mixed, q, k, v = _fused_qkv_views(seq, batch, heads, groups, dim, dtype, device)
    gen = torch.Generator(device=device).manual_seed(1)
    grad_out = torch.randn(seq, batch, heads * dim, generator=gen, device=device)
    kinds = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    forced = sdpa_kernel([kinds[backend]]) if backend else contextlib.nullcontext()
    with forced, torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = module(q, k, v)
        (out.float() * grad_out).sum().backward()
    return out.detach(), mixed.grad, {e.name for e in prof.events()}


def check_sdpa(out: dict, device: str = "cuda", shapes=SDPA_SHAPES) -> bool:
    ok, report = True, {}
    for shape in shapes:
        name, seq, batch, heads, groups, dim = shape
        module = _attention_module(heads, groups, dim)
        ref_out, ref_grad, _ = _run_attention(module, shape, torch.float32, device, "math")
        results = {}
        for backend in SDPA_BACKENDS:
            with warnings.catch_warnings(record=True) as caught:  # torch says why a backend refuses
                warnings.simplefilter("always")
                try:
                    o, g, _ = _run_attention(module, shape, torch.bfloat16, device, backend)
                    results[backend] = {"errors": {"out": rel_l2(o, ref_out), "dqkv": rel_l2(g, ref_grad)}}
                except RuntimeError as exc:
                    why = [str(exc)] + [str(w.message) for w in caught]  # torch's reasons after
                    results[backend] = {"rejected": " ".join(" ".join(why).split())[:300]}
        *_, ops = _run_attention(module, shape, torch.bfloat16, device)
        picked = backend_from_ops(ops)
        passed, problems = sdpa_verdict(results, picked)
        ok &= passed
        report[name] = {"shape": {"seq": seq, "batch": batch, "heads": heads, "groups": groups,
                                  "head_dim": dim}, "picked": picked, "backends": results,
                        "problems": problems}
        accepted = {b: f"{max(r['errors'].values()):.1e}" for b, r in results.items() if "errors" in r}
        rejected = [b for b, r in results.items() if "rejected" in r]
        print(f"sdpa: {'ok' if passed else 'FAILED'}: {name} (seq {seq}, {heads} heads / {groups} groups, "
              f"head dim {dim}, fused-QKV views): torch picks {picked}; max rel. error vs FP32 math "
              f"{accepted}; rejected: {rejected or 'none'}" + (f"; {'; '.join(problems)}" if problems else ""))
    out["sdpa"] = report
    return ok


def check_scan(out: dict) -> bool:
    # deferred: megatron (model.mamba_mixer), as in check_sync
    from model.backend import probe_machine, select_backend
    from model.mamba_mixer import mamba_kernels_how

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
        return ExitCode.SKIPPED
    out, ok = {}, True
    checks = {"sync": check_sync, "sdpa": check_sdpa, "scan": check_scan, "grad_norm": check_grad_norm}
    for name in args.sections.split(","):
        try:
            ok &= checks[name](out)
        except Exception as exc:  # a section that cannot run is a failure, the others still run
            ok = False
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"{name}: FAILED ({type(exc).__name__}: {exc})")
        if args.json:  # after each section: a part that times out keeps what it measured
            Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    return ExitCode.OK if ok else ExitCode.CHECK_FAILED


if __name__ == "__main__":
    from compat import quiet_cpu_fallback_warnings

    quiet_cpu_fallback_warnings()
    sys.exit(main())

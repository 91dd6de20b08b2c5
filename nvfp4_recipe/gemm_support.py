"""Preflight: for every low-precision GEMM, will the backend that runs it take its fast path, a
slower one, or fail? And is this device / Transformer Engine release a known-bad combination?

Pure functions over plain numbers (no torch, megatron or TE import), so the dry run can check a
cluster layout from a laptop. The caller (training/preflight.py) gives each low-precision linear's local
shape on one tensor-parallel rank; here each linear becomes its three GEMMs and their operands:

    Fprop  y  = x W^T     x (T, K) row-wise, W (N, K) row-wise
    Dgrad  dx = dY W      dY (T, N) row-wise, W column-wise
    Wgrad  dW = dY^T x    dY and x column-wise (blocks along T; the RHT'd operands in NVFP4)

T = micro-batch x sequence (the rows of one GEMM), K = in_features, N = out_features, both local.
An operand is checked as the tensor TE quantizes: rows = product of its leading dimensions,
columns = its last (TE flattens to 2-D: quantizer.cpp `flat_first_dim` / `flat_last_dim`); with
sequence parallel, the local T/tensor shard that TE quantizes before an all-gather.

Every rule names its source: TE release and file:line (read at the tags in the mirror), or this
package's own code for the emulation. Verdicts: "ok", "slower" (a fallback kernel: correct, slower
and sometimes more memory), "fail" (the backend raises, computes garbage, or computes other
numerics than the recipe the emulation reproduces): a run refuses to start on "fail" (exit 2),
naming the layer, the dimension and the tensor-parallel sizes that work.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

from nvfp4_recipe.passes import PassFormats

VERDICTS = ("ok", "slower", "fail")  # in order of severity
VERDICT_TEXT = {"ok": "ok", "slower": "slower path", "fail": "would fail"}
GEMMS = ("fprop", "dgrad", "wgrad")
GEMM_TEXT = {"fprop": "Fprop", "dgrad": "Dgrad", "wgrad": "Wgrad"}
BACKENDS = ("te", "emulated")
# The tensor-parallel sizes suggested when a layout fails (one NVLink domain and its divisors).
CANDIDATE_TENSOR_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Linear:
    """One low-precision linear on one tensor-parallel rank."""

    name: str  # "layers.3.mixer.in_proj"
    format: str  # nvfp4 | fp8 | mxfp4 | mxfp8, or a per-pass map "fprop/dgrad/wgrad"
    in_features: int  # K, local
    out_features: int  # N, local
    parallel: str = "column"  # column | row (megatron's split)


@dataclass(frozen=True)
class Setting:
    """What the GEMMs run on: backend, rows per GEMM, layout, and the recipe knobs that matter."""

    backend: str  # te | emulated
    tokens: int  # T: micro_batch_size x seq_length
    tensor: int = 1
    sequence_parallel: bool = False
    rht: bool = True  # NVFP4 random Hadamard transform on the Wgrad operands
    capability: Optional[tuple[int, int]] = None  # the GPU's, when known
    te_version: Optional[str] = None  # the installed transformer_engine, when known


@dataclass(frozen=True)
class Operand:
    tensor: str  # "x" | "W" | "dY"
    rows: int
    cols: int
    usage: str  # "rowwise" | "columnwise" (the transposed copy a GEMM reduces over rows)

    @property
    def k(self) -> int:
        """The GEMM's reduction dimension for this operand."""
        return self.cols if self.usage == "rowwise" else self.rows

    @property
    def outer(self) -> int:
        return self.rows if self.usage == "rowwise" else self.cols


def gemm_operands(tokens: int, k: int, n: int) -> dict[str, tuple[Operand, ...]]:
    """The quantized operands of the three GEMMs of a (T, K) x (N, K) linear."""
    x_row, w_row = Operand("x", tokens, k, "rowwise"), Operand("W", n, k, "rowwise")
    dy_row, w_col = Operand("dY", tokens, n, "rowwise"), Operand("W", n, k, "columnwise")
    dy_col, x_col = Operand("dY", tokens, n, "columnwise"), Operand("x", tokens, k, "columnwise")
    return {"fprop": (x_row, w_row), "dgrad": (dy_row, w_col), "wgrad": (dy_col, x_col)}


def _version(text: Optional[str]) -> Optional[tuple[int, int]]:
    match = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(match[1]), int(match[2])) if match else None


def _not_multiple(what: str, value: int, multiple: int) -> Optional[str]:
    return None if value % multiple == 0 else f"{what} {value} not a multiple of {multiple}"


# What the rows and columns of each stored operand are, in the linear's terms.
_AXES = {"x": ("T", "K"), "W": ("N", "K"), "dY": ("T", "N")}


def _dims(op: Operand, row_multiple: int, col_multiple: int) -> Optional[str]:
    rows, cols = _AXES[op.tensor]
    problems = [p for p in (_not_multiple(f"rows ({rows})", op.rows, row_multiple),
                            _not_multiple(f"columns ({cols})", op.cols, col_multiple)) if p]
    return " and ".join(problems) or None


# -- the rules -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """One requirement of a backend on a GEMM operand. `check` returns None when the operand meets
    it (or the rule does not apply), else what is wrong, e.g. "columns (N) 2832 not a multiple
    of 32"."""

    id: str
    backend: str
    formats: tuple[str, ...]
    severity: str  # "slower" | "fail"
    requirement: str
    consequence: str
    source: str
    check: Callable[[str, Operand, Linear, Setting], Optional[str]]


def _local_rows(op: Operand, linear: Linear, s: Setting) -> Optional[int]:
    """The rows of the local T/tensor shard where TE quantizes this operand before an all-gather
    of sequence parallel; None where it quantizes the whole operand:
    - a column-parallel linear's input, row-wise and column-wise, in every format (TE v2.19
      module/linear.py:378-398; LayerNormLinear through csrc/extensions/normalization.cpp:140;
      MXFP8 the same: v2.18 module/linear.py:342-372, module/layernorm_linear.py:233-252);
    - a row-parallel linear's NVFP4 dY when its shard is quantizable (rows and columns % 16);
      otherwise TE gathers it in BF16 and quantizes the whole (module/base.py:1745-1750,
      distributed.py:1384-1406). MXFP8's dY takes the same two paths (v2.18 distributed.py:
      1548-1566): a quantizable shard has whole 32-row blocks, so the gathered copy is the
      whole's either way, and only the whole is checked."""
    if not (s.sequence_parallel and s.tensor > 1):
        return None
    local = op.rows // s.tensor
    if linear.parallel == "column" and op.tensor == "x":
        return local
    if (linear.parallel == "row" and op.tensor == "dY" and linear.format == "nvfp4"
            and local % 16 == 0 and op.cols % 16 == 0):
        return local
    return None


def _te_dims(op: Operand, linear: Linear, s: Setting, row_multiple: int,
             col_multiple: int) -> Optional[str]:
    """_dims of the tensor TE quantizes: the local shard where `_local_rows` says so."""
    rows = _local_rows(op, linear, s)
    if rows is None:
        return _dims(op, row_multiple, col_multiple)
    local = Operand(op.tensor, rows, op.cols, op.usage)
    problem = _dims(local, row_multiple, col_multiple)
    return f"local shard {local.rows} x {local.cols}: {problem}" if problem else None


def _te_quantize_16(gemm, op, linear, s):
    return _te_dims(op, linear, s, 16, 16)


def _te_cast_32(gemm, op, linear, s):
    return _te_dims(op, linear, s, 32, 32)


def _te_mxfp8_quantize_32(gemm, op, linear, s):
    # Every copy TE makes (rowwise and columnwise) comes from one create_tensor over the 2-D
    # flattened tensor, which checks both dimensions whatever the usage.
    return _te_dims(op, linear, s, 32, 32)


def _te_rht_fusion(gemm, op, linear, s):
    if not s.rht or op.usage != "columnwise" or op.tensor == "W":
        return None  # RHT: column-wise copies of x and dY only (TE v2.9 recipe/__init__.py:452-467)
    problem = _te_dims(op, linear, s, 64, 128)
    te = _version(s.te_version)
    if problem is None and s.capability is not None and (te is None or te >= (2, 16)):
        if not (10, 0) <= s.capability <= (11, 0):  # v2.16 quantizer.cpp:2310-2312
            problem = f"compute capability {s.capability[0]}.{s.capability[1]} (needs 10.0-11.0)"
    return problem


def _te_fp8_sp_gather(gemm, op, linear, s):
    rows = _local_rows(op, linear, s)
    if gemm != "fprop" or rows is None:
        return None
    # Whole 128-row blocks (Float8BlockQuantizer block_len). A K that misses them also falls back
    # to the BF16 gather, but its blocks along K and T stay the shard's: the round trip of
    # power-of-two scales gives the same values, so K is not checked.
    return _not_multiple("local rows (T/tensor)", rows, 128)


def _te_fp8_exec(gemm, op, linear, s):
    if gemm != "fprop":
        return None
    return _dims(op, 8, 16)


def _te_fp8_block_gemm(gemm, op, linear, s):
    rows, cols = _AXES[op.tensor]
    k_name, outer_name = (cols, rows) if op.usage == "rowwise" else (rows, cols)
    problems = [p for p in (_not_multiple(f"reduction dimension ({k_name})", op.k, 16),
                            _not_multiple(f"outer dimension ({outer_name})", op.outer, 8)) if p]
    return " and ".join(problems) or None


def _emulated_block(block: int, fmt: str):
    def check(gemm, op, linear, s):
        # Checked once per call, before any GEMM (linear.py: each quantized pass's ops check the
        # shapes); reported on the first GEMM in this format. T is zero-padded.
        first = next(g for g in GEMMS if getattr(PassFormats(linear.format), g) == fmt)
        if gemm != first:
            return None
        if op.tensor == "x":
            return _not_multiple("K (in_features)", op.cols, block)
        problems = [p for p in (_not_multiple("N (out_features)", op.rows, block),
                                _not_multiple("K (in_features)", op.cols, block)) if p]
        return " and ".join(problems) or None
    return check


RULES: tuple[Rule, ...] = (
    Rule("te.nvfp4.quantize_16", "te", ("nvfp4",), "fail",
         "NVFP4 quantization: rows and columns multiples of 16 (with sequence parallel, a "
         "column-parallel input's local T/tensor rows)",
         "TE raises 'First dim for NVFP4 must be divisible by 16' (rows) or 'NVFP4 requires "
         "tensor dims that are divisible by 16' (columns); up to TE 2.13 a local shard first "
         "fails 'All-gather requires quantizable tensor' (v2.13 module/linear.py:178)",
         "TE v2.9 pytorch/csrc/quantizer.cpp:1185-1189 (NVFP4Quantizer::create_tensor), "
         "pytorch/tensor/nvfp4_tensor.py:180-188 (is_quantizable); v2.19 quantizer.cpp:1982-1986; "
         "local shard: v2.19 module/linear.py:378-398", _te_quantize_16),
    Rule("te.nvfp4.cast_32", "te", ("nvfp4",), "slower",
         "optimised NVFP4 cast kernel: BF16, rows and columns multiples of 32 (rows of the "
         "local shard where sequence parallel quantizes one)",
         "unoptimised cast kernel (quantize_transpose_vector_blockwise_fp4)",
         "TE v2.9 common/util/cast_kernels.cuh:2104-2125; v2.10-v2.16 "
         "common/cast/dispatch/quantize.cuh:102; v2.18 quantize.cuh:121-124", _te_cast_32),
    Rule("te.nvfp4.rht_fusion", "te", ("nvfp4",), "slower",
         "fused Hadamard+cast (Wgrad operands): rows % 64, columns % 128 (rows of the local "
         "shard where sequence parallel quantizes one), on SM 10.0-11.0 from TE 2.16",
         "separate RHT kernel, then the cast, through a columns x rows BF16 temporary",
         "TE v2.9 pytorch/csrc/quantizer.cpp:1477-1478 and 1599-1616; v2.16 :2310-2312; "
         "v2.18 :1909-1915 (is_eligible_for_rht_cast_fusion)", _te_rht_fusion),
    # MXFP8 (MXFP8BlockScaling): every operand is one quantized tensor with both copies; the
    # FP8-execution check that runs before it (leading % 8, last % 16: v2.18 utils.py:613-623,
    # called for every recipe at module/linear.py:336 and layernorm_linear.py:175) never fails
    # alone where this passes. Its cuBLASLt GEMM adds no dimension check of its own (v2.18
    # common/gemm/cublaslt_gemm.cu:179-193, 268-278, unlike FP8 block's at :209-214, 295-301),
    # only cuBLAS >= 12.8 (:500-535, the device's, which TE's is_mxfp8_available covers). The
    # cast picks a specialized kernel for some shapes and usages (common/cast/mxfp8/
    # quantize_mxfp8.cuh:671-676) and otherwise the generic TMA kernel, which TE ships as the
    # general path, not a fallback: no "slower" rule.
    Rule("te.mxfp8.quantize_32", "te", ("mxfp8",), "fail",
         "MXFP8 quantization: rows and columns of every quantized operand multiples of 32 (x: T "
         "and K, W: N and K, dY: T and N; with sequence parallel, a column-parallel input's "
         "local T/tensor rows)",
         "TE raises 'MXFP8 requires tensor dims that are divisible by 32'; up to TE 2.13 a "
         "column-parallel input's local shard first fails 'All-gather requires quantizable "
         "tensor' (v2.9 module/linear.py:169, utils.py:449-457)",
         "TE v2.0 pytorch/csrc/extensions/quantizer.cpp:177; v2.9 pytorch/csrc/quantizer.cpp:"
         "918-920; v2.18 :1492-1494 (MXFP8Quantizer::create_tensor) and pytorch/tensor/"
         "mxfp8_tensor.py:89-97 (is_quantizable: last dim % 32, product of the leading dims "
         "% 32); local shard: v2.18 module/linear.py:342-372, module/layernorm_linear.py:"
         "233-252", _te_mxfp8_quantize_32),
    # NVFP4's local shard is te.nvfp4.quantize_16's: TE quantizes it before the gather.
    Rule("te.fp8_block.sequence_parallel_gather", "te", ("fp8",), "fail",
         "FP8 block, sequence parallel: the column-parallel input is quantized on its local "
         "T/tensor rows before the all-gather, which must be whole 128-row blocks",
         "TE up to 2.13 asserts 'All-gather requires quantizable tensor'; from 2.14 it "
         "dequantizes the local FP8 copy, gathers it in BF16 and quantizes again, so Wgrad's "
         "blocks along T are quantized twice: not the emulation's numerics (not run on a GPU)",
         "TE v2.9 pytorch/module/linear.py:136-138, 169; pytorch/utils.py:449-457 "
         "(assert_dim_for_all_gather), removed in v2.14 (5fd5c3578, PR #2637); v2.19 "
         "module/linear.py:378-398, distributed.py:1133-1140", _te_fp8_sp_gather),
    Rule("te.fp8.exec_dims", "te", ("fp8",), "fail",
         "FP8 execution: product of the leading dimensions % 8, last dimension % 16",
         "TE asserts 'FP8 execution requires ...'",
         "TE v2.9 pytorch/utils.py:438-446 (assert_dim_for_fp8_exec), called at "
         "module/linear.py:168 and module/layernorm_linear.py:150", _te_fp8_exec),
    Rule("te.fp8_block.gemm_dims", "te", ("fp8",), "fail",
         "FP8 block-scaled GEMM: reduction dimension % 16, outer dimensions % 8",
         "TE raises '... requirement on NVTE_BLOCK_SCALING GEMM. Caller must pad.'",
         "TE v2.9 common/gemm/cublaslt_gemm.cu:195-201 and 271-277", _te_fp8_block_gemm),
    Rule("emulated.nvfp4.block_16", "emulated", ("nvfp4",), "fail",
         "emulated NVFP4: K and N multiples of the 16-element block (T is zero-padded)",
         "ValueError from the emulated linear",
         "nvfp4_recipe/operands.py:48-61 (_FormatOps.check_shapes), BLOCK = 16 (nvfp4.py)",
         _emulated_block(16, "nvfp4")),
    Rule("emulated.mxfp4.block_32", "emulated", ("mxfp4",), "fail",
         "emulated MXFP4: K and N multiples of the 32-element block (T is zero-padded)",
         "ValueError from the emulated linear",
         "nvfp4_recipe/operands.py:48-61 (_FormatOps.check_shapes), MX_BLOCK = 32 (mxfp4.py)",
         _emulated_block(32, "mxfp4")),
    Rule("emulated.mxfp8.block_32", "emulated", ("mxfp8",), "fail",
         "emulated MXFP8: K and N multiples of the 32-element block (T is zero-padded)",
         "ValueError from the emulated linear",
         "nvfp4_recipe/operands.py:48-61 (_FormatOps.check_shapes), MX_BLOCK = 32 (mxfp8.py)",
         _emulated_block(32, "mxfp8")),
    # Emulated FP8 zero-pads a partial 128-block (operands.py: whole_blocks_only = False): no rule.
)


# -- checking GEMMs --------------------------------------------------------------------------------


@dataclass(frozen=True)
class GemmCheck:
    linear: str
    gemm: str
    format: str
    backend: str
    shapes: dict  # operand -> [rows, cols] (as TE stores it; the Wgrad ones are transposed copies)
    verdict: str
    reasons: tuple[str, ...] = ()  # "<rule id>: <operand>: <what is wrong>"

    def as_dict(self) -> dict:
        return {"linear": self.linear, "gemm": self.gemm, "format": self.format,
                "backend": self.backend, "shapes": self.shapes, "verdict": self.verdict,
                "reasons": list(self.reasons)}


def rules_for(backend: str, fmt: str) -> list[Rule]:
    return [r for r in RULES if r.backend == backend and fmt in r.formats]


def check_linear(linear: Linear, setting: Setting) -> list[GemmCheck]:
    """The three GEMMs of one linear under one setting, each with its verdict and reasons."""
    if setting.backend not in BACKENDS:
        raise ValueError(f"unknown backend {setting.backend!r}")
    out = []
    operands = gemm_operands(setting.tokens, linear.in_features, linear.out_features)
    formats = PassFormats(linear.format)  # a per-pass map: each GEMM under its own format's rules
    for gemm in GEMMS:
        fmt = getattr(formats, gemm)
        rules = rules_for(setting.backend, fmt)
        verdict, reasons = "ok", []
        for op in operands[gemm]:
            for rule in rules:
                problem = rule.check(gemm, op, linear, setting)
                if problem:
                    reasons.append(f"{rule.id}: {op.tensor} {op.rows} x {op.cols}: {problem}")
                    verdict = max(verdict, rule.severity, key=VERDICTS.index)
        shapes = {f"{op.tensor}{'' if op.usage == 'rowwise' else '^T'}": [op.rows, op.cols]
                  for op in operands[gemm]}
        out.append(GemmCheck(linear.name, gemm, fmt, setting.backend, shapes, verdict,
                             tuple(dict.fromkeys(reasons))))
    return out


def check_linears(linears: Iterable[Linear], setting: Setting) -> list[GemmCheck]:
    return [c for linear in linears for c in check_linear(linear, setting)]


def worst(checks: Iterable[GemmCheck]) -> str:
    return max((c.verdict for c in checks), default="ok", key=VERDICTS.index)


# -- known-bad devices and releases ----------------------------------------------------------------


@dataclass(frozen=True)
class DeviceSetting:
    capability: Optional[tuple[int, int]]
    te_version: Optional[str]
    formats: tuple[str, ...]  # the low-precision formats TE runs
    rht: bool = True
    stochastic_rounding: bool = True
    activation_dtype: str = "bf16"  # what the GEMMs receive (training: BF16, Float16Module)


@dataclass(frozen=True)
class KnownBad:
    id: str
    severity: str  # "slower" | "fail"
    when: str
    effect: str
    remedy: str
    source: str
    applies: Callable[[DeviceSetting], bool]

    def as_dict(self) -> dict:
        return {"id": self.id, "severity": self.severity, "when": self.when,
                "effect": self.effect, "remedy": self.remedy, "source": self.source}


def _te_between(d: DeviceSetting, low: tuple[int, int], high: Optional[tuple[int, int]]) -> bool:
    te = _version(d.te_version)
    return te is not None and low <= te and (high is None or te <= high)


def _sm12x(d: DeviceSetting) -> bool:
    return d.capability is not None and d.capability[0] == 12


KNOWN_BAD: tuple[KnownBad, ...] = (
    KnownBad("te.sm12x_stochastic_rounding_zeros", "fail",
             "NVFP4 with stochastic rounding, compute capability 12.x, TE 2.8-2.18",
             "the gradient quantization returns all-zero FP4 data (no cvt.rs instruction on "
             "sm_120/121; the device-side error is compiled out of release builds), while "
             "is_nvfp4_available() says yes: training runs on zero gradients",
             "precision.stochastic_rounding=false, precision.backend=emulated, or a TE with "
             "the fix",
             "https://github.com/NVIDIA/TransformerEngine/pull/3281 (fix commit fc1fc0e: not in "
             "v2.18, first in release_v2.19: software rounding at util/ptx.cuh:607-628)",
             lambda d: "nvfp4" in d.formats and d.stochastic_rounding and _sm12x(d)
             and _te_between(d, (2, 8), (2, 18))),
    KnownBad("te.sm12x_rht_crash", "fail",
             "NVFP4 with RHT or stochastic rounding, compute capability 12.x, TE 2.14 or newer "
             "(open issue)",
             "the fused RHT kernel exceeds sm_120's shared memory: 'CUDA Error: invalid argument' "
             "in row_cast_col_hadamard_transform_cast_fusion.cu (that file appears in v2.14)",
             "precision.rht=false and precision.stochastic_rounding=false, or "
             "precision.backend=emulated",
             "https://github.com/NVIDIA/TransformerEngine/issues/3062 (filed the day v2.16 was "
             "tagged; v2.16 stops launching that kernel outside SM 10.0-11.0, d5e7087db, "
             "quantizer.cpp:1909-1915 in v2.18: kept until a GPU shows the issue's release)",
             lambda d: "nvfp4" in d.formats and (d.rht or d.stochastic_rounding) and _sm12x(d)
             and _te_between(d, (2, 14), None)),
    KnownBad("te.2.12_tuned_cast_disabled", "slower",
             "NVFP4, TE 2.12",
             "the tuned 1-D NVFP4 cast kernel is switched off over a numerics mismatch "
             "(activations and gradients take the older kernel; re-enabled in 2.13 after "
             "PR #2639)",
             "TE 2.13 or newer",
             "https://github.com/NVIDIA/TransformerEngine/pull/2615; TE v2.12 "
             "common/cast/nvfp4/quantize_transpose_nvfp4.cuh:1171-1174 (commented out), "
             "v2.13 :1171-1174",
             lambda d: "nvfp4" in d.formats and _version(d.te_version) == (2, 12)),
    KnownBad("te.rht_needs_bf16", "fail",
             "NVFP4 with RHT on non-BF16 activations",
             "TE raises 'RHT is only supported for bfloat16 input'",
             "BF16 activations (the trainer's Float16Module does this) or precision.rht=false",
             "TE v2.9 pytorch/csrc/quantizer.cpp:1481-1483; v2.18 :2608-2611; v2.19 :2631-2634",
             lambda d: "nvfp4" in d.formats and d.rht and d.activation_dtype != "bf16"),
)


def known_bad_hits(device: DeviceSetting) -> list[KnownBad]:
    return [entry for entry in KNOWN_BAD if entry.applies(device)]


# -- the report ------------------------------------------------------------------------------------


@dataclass
class Report:
    """The preflight of one run: every low-precision GEMM under each backend, the known-bad
    combinations that apply, and per candidate tensor-parallel size the worst verdict."""

    tensor: int
    tokens: int
    sequence_parallel: bool
    checks: list[GemmCheck] = field(default_factory=list)
    layout_problems: list[str] = field(default_factory=list)  # megatron cannot split the model
    device: dict = field(default_factory=dict)  # capability, te_version, hits (ids)
    device_hits: list[KnownBad] = field(default_factory=list)
    layouts: dict = field(default_factory=dict)  # tensor -> backend -> {verdict, linears}

    @property
    def verdict(self) -> str:
        hits = [h.severity for h in self.device_hits]
        layout = ["fail"] if self.layout_problems else []
        return max([worst(self.checks), *hits, *layout], key=VERDICTS.index)

    def counts(self, backend: str) -> dict[str, int]:
        out = {v: 0 for v in VERDICTS}
        for c in self.checks:
            if c.backend == backend:
                out[c.verdict] += 1
        return out

    def backends(self) -> list[str]:
        return list(dict.fromkeys(c.backend for c in self.checks))

    def problems(self) -> list[str]:
        """One message per group of GEMMs with the same problem (layers in runs), worst first,
        each naming the tensor-parallel sizes where that linear is clean / works."""
        groups: dict[tuple, list[int]] = {}
        checked: dict[tuple, list[int]] = {}  # (backend, linear, gemm) -> every layer checked
        for c in self.checks:
            layer, suffix = _split_name(c.linear)
            checked.setdefault((c.backend, suffix, c.gemm), []).append(layer)
            if c.verdict == "ok":
                continue
            key = (c.verdict, c.backend, suffix, c.gemm, c.format, c.reasons)
            groups.setdefault(key, []).append(layer)
        lines = []
        for key in sorted(groups, key=lambda k: (-VERDICTS.index(k[0]), k[1], k[2],
                                                 GEMMS.index(k[3]))):
            verdict, backend, suffix, gemm, fmt, reasons = key
            layers = _runs(groups[key], checked[(backend, suffix, gemm)])
            where = self.layouts_for(suffix, backend)
            if verdict == "fail":
                where += f"; or keep it in BF16: ++precision.overrides={{*.{suffix}:bf16}}"
            lines.append(
                f"{VERDICT_TEXT[verdict]} on {backend}: {suffix} {GEMM_TEXT[gemm]} ({fmt}) in "
                f"layers {layers} at tensor {self.tensor}, {self.tokens} rows per GEMM: "
                + "; ".join(reasons) + where)
        lines += [f"would fail: {p}" for p in self.layout_problems]
        lines += [f"{VERDICT_TEXT[h.severity]} on te: {h.effect} [{h.when}; {h.source}]; "
                  f"fix: {h.remedy}" for h in self.device_hits]
        return lines

    def layouts_for(self, suffix: str, backend: str) -> str:
        works, clean = [], []
        for t, per_backend in sorted(self.layouts.items()):
            entry = per_backend.get(backend, {})
            linear = entry.get("linears", {}).get(suffix)
            if linear is None:
                continue
            if linear != "fail":
                works.append(t)
            if linear == "ok":
                clean.append(t)
        if not self.layouts:
            return ""
        return (f"; tensor sizes where {suffix} works: {_list(works)}, runs clean: "
                f"{_list(clean)}")

    def summary(self) -> list[str]:
        """The compact start-up lines: counts per backend, then the problems."""
        head = []
        for backend in self.backends():
            n = self.counts(backend)
            head.append(f"preflight ({backend}; tensor {self.tensor}, {self.tokens} rows per "
                        f"GEMM{', sequence parallel' if self.sequence_parallel else ''}): "
                        f"{sum(n.values())} low-precision GEMMs: {n['ok']} ok, {n['slower']} "
                        f"slower path, {n['fail']} would fail")
        if not head:
            head.append("preflight: no low-precision GEMM")
        if self.device:
            hits = ", ".join(h.id for h in self.device_hits) or "no known-bad combination"
            head.append(f"preflight device: {self.device.get('describe', '')}: {hits}")
        if self.layouts:
            head.append("preflight layouts: " + "; ".join(
                f"tensor {t}: " + ", ".join(f"{b} {VERDICT_TEXT[e['verdict']]}"
                                            for b, e in per.items())
                for t, per in sorted(self.layouts.items())))
        return head + self.problems()

    def as_dict(self) -> dict:
        return {
            "verdict": self.verdict,
            "tensor": self.tensor, "rows_per_gemm": self.tokens,
            "sequence_parallel": self.sequence_parallel,
            "counts": {b: self.counts(b) for b in self.backends()},
            "problems": self.problems(),
            "layout_problems": self.layout_problems,
            "layouts": {str(t): v for t, v in sorted(self.layouts.items())},
            "device": {**self.device, "hits": [h.id for h in self.device_hits]},
            "known_bad": [entry.as_dict() for entry in KNOWN_BAD],
            "rules": [{"id": r.id, "backend": r.backend, "formats": list(r.formats),
                       "severity": r.severity, "requirement": r.requirement,
                       "consequence": r.consequence, "source": r.source} for r in RULES],
            "gemms": [c.as_dict() for c in self.checks],
        }

    def refusal(self) -> Optional[str]:
        """The error message when the run must not start (None when it may)."""
        if self.verdict != "fail":
            return None
        fails = [p for p in self.problems() if p.startswith(VERDICT_TEXT["fail"])]
        return "preflight: " + " | ".join(fails)


def layout_verdicts(checks: Sequence[GemmCheck]) -> dict:
    """{backend: {"verdict": worst, "linears": {module name: worst over its layers and GEMMs}}}."""
    out: dict = {}
    for c in checks:
        entry = out.setdefault(c.backend, {"verdict": "ok", "linears": {}})
        suffix = _split_name(c.linear)[1]
        entry["linears"][suffix] = max(entry["linears"].get(suffix, "ok"), c.verdict,
                                       key=VERDICTS.index)
        entry["verdict"] = max(entry["verdict"], c.verdict, key=VERDICTS.index)
    return out


def _split_name(name: str) -> tuple[int, str]:
    """"layers.12.mixer.in_proj" -> (12, "mixer.in_proj")."""
    _, index, suffix = name.split(".", 2)
    return int(index), suffix


def _runs(indices: Sequence[int], universe: Sequence[int]) -> str:
    """Runs of `indices` that are consecutive within `universe` (the layers checked for this
    linear), as in the precision map: [4, 6, 8, 12] of [2, 4, 6, 8, 10, 12] -> "4-8,12"."""
    chosen, spans = set(indices), []
    for index in sorted(universe):
        if index in chosen and spans and spans[-1][2]:
            spans[-1][1] = index
        elif index in chosen:
            spans.append([index, index, True])
        elif spans:
            spans[-1][2] = False
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b, _ in spans)


def _list(values: Sequence[int]) -> str:
    return ", ".join(map(str, values)) if values else "none of " + ", ".join(
        map(str, CANDIDATE_TENSOR_SIZES))

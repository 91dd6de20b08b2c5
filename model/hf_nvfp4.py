"""NVFP4 serving exports: the weights an NVFP4 run's forward pass computed with, in the two
checkpoint formats vLLM and TensorRT-LLM load (`python -m tools.hf_export RUN_DIR
--weights nvfp4 --format compressed-tensors|modelopt`).

Every linear the run trained in NVFP4 (the run's precision policy: BF16 first/last layers and
`precision.overrides` stay BF16) is quantized from the checkpoint's BF16 weight by this project's
own quantizer (nvfp4_recipe.nvfp4.quantize_nvfp4: round to nearest, the run's 1x16 or 16x16
weight scaling, TE's arithmetic), i.e. exactly as the emulated Fprop quantizes it at tensor
parallel 1, before it is split into transformers' modules (linear_qkv -> q/k/v_proj share one
tensor scale, as vLLM's fused qkv_proj needs). A 16x16 tile's scale is stored repeated over its
16 rows, so both formats, which take one E4M3 scale per 1x16 block of a row, hold it exactly.

The formats, as their libraries define them (cited from the installed sources):

compressed-tensors 0.20.1, format "nvfp4-pack-quantized", vLLM's W4A4 / W4A16 NVFP4 schemes:
- tensors `weight_packed` uint8 (N, K/2), `weight_scale` float8_e4m3fn (N, K/16),
  `weight_global_scale` float32 [1], and for W4A4 `input_global_scale` float32 [1]
  (compressors/nvfp4/base.py:37-47);
- the global scales are ENCODE scales: dequantization divides by them,
  `scale = scale / global_scale` then `x_q * scale` (quantization/lifecycle/forward_helpers.py:
  557-563), and the library computes them as 448 * 6 / amax (quantization/utils/helpers.py:344):
  this project's S_enc;
- nibbles: the even column (the first of a pair) in the low nibble,
  `packed = indices[:, 0] | (indices[:, 1] << 4)` (compressors/nvfp4/helpers.py:412; unpacked
  low-then-high at :436-440); code bit 3 is the sign, bits 0-2 index {0, .5, 1, 1.5, 2, 3, 4, 6};
- config.json `quantization_config`: what `ModelCompressor.update_config` writes
  (compressors/model_compressors/model_compressor.py:219-253) for the preset schemes NVFP4 /
  NVFP4A16 (quantization/quant_scheme.py:170-206), targets ["Linear"], the BF16 linears in
  `ignore`.

nvidia-modelopt 0.47.0, quant_algo "NVFP4" (TensorRT-LLM; vLLM's ModelOpt loader):
- tensors `weight` uint8 (N, K/2), `weight_scale` float8_e4m3fn (N, K/16), `weight_scale_2`
  float32 0-d, `input_scale` float32 0-d;
- the second-level scales are DECODE scales: `weight_scale_2 = amax / (6 * 448)`
  (torch/quantization/qtensor/nvfp4_tensor.py:208), `input_scale = amax / (6 * 448)` (:222), and
  dequantization multiplies, `per_block_scale = weight_scale * weight_scale_2` then
  `e2m1 * per_block_scale` (:400, :407): this project's S_dec;
- nibbles: `packed = (q[..., 1::2] << 4) | q[..., 0::2]` (:338; unpacked at :356-357): the even
  column in the low nibble, as compressed-tensors and TE;
- hf_quant_config.json `{"producer", "quantization": {"quant_algo": "NVFP4", "group_size": 16,
  "kv_cache_quant_algo": null, "exclude_modules": [...]}}` (torch/export/quant_utils.py:1620-1630,
  :729-733, :778-788; written at torch/export/unified_export_hf.py:1477-1478) and config.json's
  `quantization_config` converted from it (torch/export/convert_hf_config.py:191-203, :261-281).
compressed-tensors' own ModelOpt converter states the same relation: CT global scale = 1 / ModelOpt
scale for weights and inputs (entrypoints/convert/converters/modelopt_nvfp4.py:97-122).

The scales stored are the values the forward used: S_enc = min(448 * 6 / amax, FLT_MAX) and
S_dec = 1 / S_enc (nvfp4.tensor_scales), not recomputed as amax / 2688 (which can differ by an
ulp). The activation scales come from the run's recorded input amax
(nvfp4_recipe/megatron/input_amax.py), through the same tensor_scales.

A linear whose recorded amax gives no usable static input scale (0: every input of the window
all-zero or non-finite, which the recorder counts as 0; below 448 * 6 / FLT_MAX; or non-finite,
from a damaged window) has no W4A4 export: S_enc would be FLT_MAX (the serving engine multiplies
its inputs by 3.4e38), NaN, or 1 (tensor_scales maps an infinite amax's S_enc of 0 to 1).
unusable_input_amax finds them; the export refuses them, or writes them weights-only (W4A16)
when asked (`--zero-amax weights-only`). compressed-tensors expresses that per linear with a
second config group whose `input_activations` is null (the NVFP4A16 preset's group), which both
compressed-tensors and vLLM resolve per module: compressed-tensors 0.20.1 orders a module's
matching targets exact name, regex, class name (utils/match.py:116-151) and takes the first
(quantization/lifecycle/apply.py:139-161, :245-252); vLLM keeps one scheme per target
(compressed_tensors.py `_quantization_scheme_map_from_config`), looks a layer up by
`find_matched_target` (utils.py: the layer name exactly or by `re:`, then the module's CLASS
name as a case-insensitive substring, then a fused layer through its parts) and serves an NVFP4
weight without input args as CompressedTensorsW4A16Fp4 (`_get_scheme_from_parts`; vLLM read
from its main branch's source, not run). Because
"Linear" is a substring of vLLM's QKVParallelLinear, a fused qkv_proj would match a "Linear"
target before its q/k/v names: with weights-only linears every group therefore lists its
modules by name. ModelOpt's `quant_algo: NVFP4` has one algorithm for every quantized linear
(each with an `input_scale`); a per-linear W4A16 needs its MIXED_PRECISION layout, which this
export does not write, so that combination is refused.

MXFP8 linears (a linear whose forward ran in MXFP8: `precision=mxfp8`, or an override such as
the Nemotron 3 map's Mamba out_proj) are written, in the compressed-tensors export, in
compressed-tensors' own MXFP8 format, which vLLM serves, with the forward's weight operand:
nvfp4_recipe.mxfp8.quantize_mxfp8 of the BF16 weight, 1x32 blocks along K (TE's rowwise copy,
what Fprop multiplies), bit for bit.
- compressed-tensors 0.20.1, format "mxfp8-quantized" (config/base.py:33): tensors `weight`
  float8_e4m3fn (N, K) and `weight_scale` uint8 (N, K/32) holding the biased E8M0 exponent e,
  scale 2**(e - 127) (compressors/mxfp8/base.py:28-104, mx_utils.py:18-44); dequantization
  multiplies, `x_q * scale` (compressors/naive_quantized/base.py:99-124); the preset MXFP8
  (quantization/quant_scheme.py:315-336): weights and dynamic input activations, 8-bit float,
  group 32, strategy group, scale_dtype uint8. The activations are quantized by the serving
  engine per call (no input scale is stored). A model with NVFP4 and MXFP8 groups has the
  global format "mixed-precision" and a format per group (quantization/quant_config.py:360-364).
- vLLM 0.33.0 (wheel, read not run): `_is_mxfp8` (8-bit float, group 32, symmetric, strategy
  group, scale_dtype uint8: compressed_tensors/compressed_tensors.py:491-510) selects
  CompressedTensorsW8A8Mxfp8 (:814-815), which loads `weight` float8_e4m3fn (N, K) and
  `weight_scale` uint8 (N, K/32) (schemes/compressed_tensors_w8a8_mxfp8.py:40-77; dtypes
  utils/mxfp8_utils.py:9-11) and decodes them as `x * 2**(e - 127)` (dequant_mxfp8_to_bf16,
  mxfp8_utils.py:230-243); each group's own `format` is used (compressed_tensors.py:349-356),
  and its input_activations read because they are given (:359-375). Every group then names its
  modules, as for weights-only NVFP4 linears: a "Linear" target would take a fused qkv_proj
  before its q/k/v names.
In the ModelOpt export the MXFP8 linears are written in BF16 (listed in exclude_modules):
ModelOpt's `quant_algo` names one algorithm for the whole model and this export does not write
its per-layer MIXED_PRECISION layout. The export says which (its log and nvfp4_export.json's
`mxfp8_linears`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Mapping, Optional

import torch

from nvfp4_recipe.formats import FP32_MAX
from nvfp4_recipe.mxfp8 import MX_BLOCK, quantize_mxfp8
from nvfp4_recipe.nvfp4 import BLOCK, quantize_nvfp4, tensor_scales

from .config import ModelConfig
from .hf import HFError, _in_proj_parts, split_experts, split_qkv

FORMATS = ("compressed-tensors", "modelopt")
MXFP8_FORMAT = "mxfp8-quantized"  # compressed-tensors' name for MXFP8 weights (module docstring)
# The format versions whose definitions this module follows (see the docstring).
COMPRESSED_TENSORS_VERSION = "0.20.1"
MODELOPT_VERSION = "0.47.0"
PRODUCER = {"name": "nvfp4-pretrain", "version": "0.1.0"}

# Each megatron linear -> the transformers NemotronH modules it becomes (rows in this order).
HF_MODULES = {
    "mixer.in_proj": ("mixer.in_proj",),
    "mixer.out_proj": ("mixer.out_proj",),
    "self_attention.linear_qkv": ("mixer.q_proj", "mixer.k_proj", "mixer.v_proj"),
    "self_attention.linear_proj": ("mixer.o_proj",),
    "mlp.linear_fc1": ("mixer.up_proj",),
    "mlp.linear_fc2": ("mixer.down_proj",),
}


# An MoE layer's linears (model/config.py's names; transformers' NemotronHMoE modules). The routed
# experts are stored one module per expert, as NVIDIA's checkpoints and vLLM's nemotron_h name them
# (model/hf.py split_experts).
_ROUTED_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])$")
_EXPERT_PROJ = {"1": "up_proj", "2": "down_proj"}
_SHARED_EXPERT = {"mlp.shared_experts.linear_fc1": ("mixer.shared_experts.up_proj",),
                  "mlp.shared_experts.linear_fc2": ("mixer.shared_experts.down_proj",)}
# A transformers module name of a routed expert: model.layers.<i>.mixer.experts.<e>.<proj>
_EXPERT_MODULE = re.compile(r"^model\.layers\.(\d+)\.mixer\.experts\.\d+\.(up|down)_proj$")


def hf_modules(name: str) -> tuple[str, ...]:
    """The transformers NemotronH modules a megatron linear becomes (rows in this order)."""
    if name in HF_MODULES:
        return HF_MODULES[name]
    if name in _SHARED_EXPERT:
        return _SHARED_EXPERT[name]
    expert = _ROUTED_EXPERT.match(name)
    if expert is None:
        raise KeyError(name)
    return (f"mixer.experts.{expert[1]}.{_EXPERT_PROJ[expert[2]]}",)


def experts_pattern(index: int) -> str:
    """The compressed-tensors `re:` name of every routed expert module of pattern layer `index`.
    vLLM resolves an MoE layer's scheme from three names, `<layer>.mixer.experts.0.up_proj`,
    `.0.None` (nemotron_h's experts have no gate: ckpt names ("up_proj", "down_proj", None)) and
    `.0.down_proj`, and refuses the layer unless all three resolve alike (vLLM 0.33.0-0.34.0
    compressed_tensors_moe.py:33-58): listing the experts by name would leave `.0.None`
    unmatched. This pattern matches all three, in `targets` and in `ignore`."""
    return f"re:.*layers\\.{index}\\.mixer\\.experts\\..*"


def with_expert_patterns(names) -> list[str]:
    """`names` (transformers modules) with each MoE layer's routed experts as experts_pattern;
    the caller keeps a layer's experts in one list (check_moe_servable)."""
    out = set()
    for name in names:
        expert = _EXPERT_MODULE.match(name)
        out.add(experts_pattern(int(expert[1])) if expert else name)
    return sorted(out)


def routed_expert_formats(formats: Mapping[str, str]) -> dict[int, set[str]]:
    """{MoE pattern layer: the forward formats of its routed experts}."""
    out: dict[int, set[str]] = {}
    for key, fmt in forward_formats(formats).items():
        _, index, name = key.split(".", 2)
        if _ROUTED_EXPERT.match(name):
            out.setdefault(int(index), set()).add(fmt)
    return out


def check_moe_servable(formats: Mapping[str, str], fmt: str, weights: str) -> None:
    """HFError (exit 2) for MoE layers this serving export cannot write: vLLM serves one scheme
    per MoE layer, so a layer's routed experts must share their forward format; the experts are
    written NVFP4 in compressed-tensors only (ModelOpt's NVFP4 layout and compressed-tensors'
    MXFP8 for experts are not written here)."""
    for index, found in sorted(routed_expert_formats(formats).items()):
        if len(found) > 1:
            raise HFError(f"--weights {weights}: layer {index}'s routed experts ran their forward "
                          f"in {' and '.join(sorted(found))}; vLLM serves one scheme per MoE "
                          "layer: give them one format, or use --weights bf16")
        (one,) = found
        if one == "mxfp8":
            raise HFError(f"--weights {weights}: layer {index}'s routed experts ran in MXFP8, "
                          "which this export writes for dense linears only; use --weights bf16")
        if one == "nvfp4" and fmt != "compressed-tensors":
            raise HFError(f"--format {fmt}: layer {index}'s routed experts are written in "
                          "compressed-tensors only; use --format compressed-tensors")


def fill_expert_input_amax(amax: Mapping[str, float], formats: Mapping[str, str]
                           ) -> dict[str, float]:
    """The recorded input amax with each NVFP4 routed expert that saw no usable input in the
    window (no token routed to it: amax 0) given the largest amax of its layer's experts for the
    same projection. vLLM's FlashInfer NVFP4 MoE kernels quantize every expert's input with one
    scale, from that largest amax (vLLM 0.34.0 compressed_tensors_moe_w4a4_nvfp4.py:242-243,
    quantization/utils/quant_utils.py:77-96), and one scheme per layer leaves no expert
    weights-only beside the others. A layer with no usable amax at all is left as it is (the
    export refuses it, or writes the whole layer weights-only)."""
    out = dict(amax)
    bad = unusable_input_amax(amax, formats)
    groups: dict[tuple[str, str], list[str]] = {}
    for key, fmt in formats.items():
        _, index, name = key.split(".", 2)
        expert = _ROUTED_EXPERT.match(name)
        if fmt == "nvfp4" and expert and key in amax:
            groups.setdefault((index, expert[2]), []).append(key)
    for keys in groups.values():
        usable = [amax[k] for k in keys if k not in bad]
        if usable:
            out.update({k: max(usable) for k in keys if k in bad})
    return out


@dataclass
class PackedLinear:
    """One transformers linear's NVFP4 weight: codes, per-16 scales, the FP32 tensor scales."""

    packed: torch.Tensor  # uint8 (N, K/2), even column in the low nibble
    scales: torch.Tensor  # float8_e4m3fn (N, K/16)
    s_enc: torch.Tensor  # float32 0-d, 448 * 6 / amax of the whole megatron weight
    s_dec: torch.Tensor  # float32 0-d, 1 / s_enc


@dataclass
class MXFP8Linear:
    """One transformers linear's MXFP8 weight, as compressed-tensors stores it."""

    weight: torch.Tensor  # float8_e4m3fn (N, K): E4M3 values
    scale: torch.Tensor  # uint8 (N, K/32): biased E8M0 exponents e, scale 2**(e - 127)


@dataclass
class ServingExport:
    """What write_hf_dir writes for a quantized export (names as NemotronHForCausalLM's)."""

    tensors: dict[str, torch.Tensor]
    quantization_config: dict
    extra_files: dict[str, dict] = field(default_factory=dict)
    bf16_linears: list[str] = field(default_factory=list)  # transformers module names
    weights_only: list[str] = field(default_factory=list)  # NVFP4 linears without input scale


def forward_formats(formats: Mapping[str, str]) -> dict[str, str]:
    """{linear: the format its forward (Fprop) ran in}: the weights a serving export writes are
    the forward's, whatever the backward ran in. A per-pass format (the policy's PassFormats,
    "fprop/dgrad/wgrad") gives its `fprop`; a plain name is all three passes'."""
    return {key: str(getattr(fmt, "fprop", fmt)) for key, fmt in formats.items()}


def megatron_weight(full: Mapping[str, torch.Tensor], cfg: ModelConfig, index: int,
                    name: str) -> torch.Tensor:
    """The weight of linear `name` of pattern layer `index` as the model holds it (the
    checkpoint stores Mamba's in_proj in its [z, x, B, C, dt] parts)."""
    prefix = f"decoder.layers.{index}.{name}.weight"
    expert = _ROUTED_EXPERT.match(name)
    if expert:  # megatron checkpoints a layer's experts as one [experts, out, in] tensor
        return full[f"decoder.layers.{index}.mlp.experts.experts.linear_fc{expert[2]}.weight"][
            int(expert[1])]
    if name == "mixer.in_proj":
        return torch.cat([full[f"{prefix}.{p}"] for p, _ in _in_proj_parts(cfg)])
    return full[prefix]


def check_packable(name: str, weight: torch.Tensor, tile_rows: int) -> None:
    """HFError (exit 2) when the weight cannot be stored as NVFP4."""
    n, k = weight.shape
    if k % BLOCK or n % tile_rows:
        need = f"K a multiple of {BLOCK}" + (f" and N a multiple of {tile_rows} (16x16 tiles)"
                                             if tile_rows > 1 else "")
        raise HFError(f"{name}: weight {n}x{k} cannot be packed as NVFP4 ({need}); export it "
                      "with --weights bf16")


def quantize_linear(weight: torch.Tensor, tile_rows: int):
    """The NVFP4 weight operand of the emulated Fprop (linear.py: weight.to(bf16), round to
    nearest, 16x16 tiles when precision.weight_2d) as codes and scales."""
    return quantize_nvfp4(weight.to(torch.bfloat16), (tile_rows, BLOCK), "nearest",
                          kernels="eager")


def packed_linears(full: Mapping[str, torch.Tensor], cfg: ModelConfig,
                   formats: Mapping[str, str], weight_2d: bool) -> dict[str, PackedLinear]:
    """{transformers module name (model.layers.i.mixer.x): PackedLinear} of every NVFP4 linear.

    `formats`: the precision policy's {`layers.<i>.<megatron name>`: format}."""
    tile_rows = BLOCK if weight_2d else 1
    out = {}
    for key, fmt in formats.items():
        if fmt != "nvfp4":
            continue
        _, index, name = key.split(".", 2)
        weight = megatron_weight(full, cfg, int(index), name)
        check_packable(key, weight, tile_rows)
        q = quantize_linear(weight, tile_rows)
        s_enc, s_dec = tensor_scales(q.amax)
        packed, scales = q.data, q.scales.view(torch.uint8)  # row splits on bytes
        dst = f"model.layers.{index}."
        parts = hf_modules(name)
        if name == "self_attention.linear_qkv":
            split = zip(split_qkv(packed, cfg), split_qkv(scales, cfg))
        else:
            split = [(packed, scales)]
        for hf_name, (p, s) in zip(parts, split):
            out[dst + hf_name] = PackedLinear(p.contiguous(),
                                              s.contiguous().view(torch.float8_e4m3fn),
                                              s_enc.float(), s_dec.float())
    return out


def mxfp8_linears(full: Mapping[str, torch.Tensor], cfg: ModelConfig,
                  formats: Mapping[str, str]) -> dict[str, MXFP8Linear]:
    """{transformers module name: MXFP8Linear} of every linear whose forward ran in MXFP8: the
    emulated Fprop's weight operand (linear.py: the BF16 weight, quantize_mxfp8 with 1x32
    blocks along K), split as the BF16 export splits it (a block never spans two rows, so the
    q/k/v rows keep their scales). HFError (exit 2) for a K that is not whole blocks."""
    out = {}
    for key, fmt in forward_formats(formats).items():
        if fmt != "mxfp8":
            continue
        _, index, name = key.split(".", 2)
        weight = megatron_weight(full, cfg, int(index), name)
        n, k = weight.shape
        if k % MX_BLOCK:
            raise HFError(f"{key}: weight {n}x{k} cannot be stored as MXFP8 (K a multiple of "
                          f"{MX_BLOCK}); export it with --weights bf16")
        q = quantize_mxfp8(weight.to(torch.bfloat16))
        data, scale = q.data.view(torch.uint8), q.scales.view(torch.uint8)
        if name == "self_attention.linear_qkv":
            split = zip(split_qkv(data, cfg), split_qkv(scale, cfg))
        else:
            split = [(data, scale)]
        for hf_name, (d, sc) in zip(hf_modules(name), split):
            out[f"model.layers.{index}.{hf_name}"] = MXFP8Linear(
                d.contiguous().view(torch.float8_e4m3fn), sc.contiguous())
    return out


def unusable_input_amax(amax: Mapping[str, float], formats: Mapping[str, str]
                        ) -> dict[str, float]:
    """{linear: recorded amax} of the NVFP4 linears whose amax gives no usable static input
    scale: non-finite, <= 0, or so small that S_enc is clamped to FLT_MAX (module docstring)."""
    out = {}
    for key, fmt in formats.items():
        if fmt != "nvfp4" or key not in amax:
            continue
        value = float(amax[key])
        if not math.isfinite(value) or value <= 0:
            out[key] = value
            continue
        s_enc, _ = tensor_scales(torch.tensor(value, dtype=torch.float32))
        if float(s_enc) >= FP32_MAX:
            out[key] = value
    return out


def amax_problem(key: str, value: float, steps: Optional[int] = None) -> str:
    """One clause naming a linear of unusable_input_amax and why its input scale is unusable."""
    window = f" over the {steps}-step window" if steps else ""
    if not math.isfinite(value) or value < 0:  # the recorder writes neither: a damaged window
        what = "negative" if value < 0 else "non-finite"
        return (f"{key}: recorded input amax is {value} ({what}: a damaged amax window in "
                "trainer.pt); no static input scale follows from it")
    if value == 0:
        return (f"{key}: recorded input amax is 0{window} (all-zero or non-finite inputs); its "
                "static input scale would be FLT_MAX")
    return (f"{key}: recorded input amax is {value:.3g}{window}; its static input scale "
            "448*6/amax would be clamped to FLT_MAX")


def hf_names(key: str) -> list[str]:
    """The transformers modules of policy linear `layers.<i>.<megatron name>`."""
    _, index, name = key.split(".", 2)
    return [f"model.layers.{index}.{m}" for m in hf_modules(name)]


def input_scales(amax: Mapping[str, float], formats: Mapping[str, str],
                 skip: frozenset[str] = frozenset()
                 ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{transformers module name: (S_enc, S_dec) of its input} from the recorded input amax
    ({`layers.<i>.<megatron name>`: amax}), by the quantizer's own tensor_scales; the linears in
    `skip` (exported weights-only) get none. Any other unusable amax is a bug of the caller."""
    bad = sorted(set(unusable_input_amax(amax, formats)) - set(skip))
    if bad:
        raise HFError(amax_problem(bad[0], float(amax[bad[0]])))
    out = {}
    for key, fmt in formats.items():
        if fmt != "nvfp4" or key in skip:
            continue
        s_enc, s_dec = tensor_scales(torch.tensor(amax[key], dtype=torch.float32))
        for hf_name in hf_names(key):
            out[hf_name] = (s_enc, s_dec)
    return out


def bf16_linear_names(cfg: ModelConfig, formats: Mapping[str, str],
                      quantized: tuple[str, ...] = ("nvfp4",)) -> list[str]:
    """The transformers linears the export writes in BF16: lm_head and every linear whose
    forward format is not among `quantized` (the formats this export writes quantized)."""
    names = ["lm_head"]
    for key, fmt in forward_formats(formats).items():
        if fmt not in quantized:
            _, index, name = key.split(".", 2)
            names += [f"model.layers.{index}.{m}" for m in hf_modules(name)]
    return names


def vllm_limits(cfg: ModelConfig, formats: Mapping[str, str]) -> list[str]:
    """What vLLM cannot serve of this export, one warning each (read: vLLM 0.33.0).

    With one Mamba group, vLLM's in_proj replicates the group over tensor-parallel ranks and
    re-targets its sharding loader to the parameters named `weight`, `weight_scale` and
    `input_scale` only (model_executor/layers/mamba/mamba_mixer2.py:320-323, 384-390,
    456-467): compressed-tensors' `weight_packed` and ModelOpt's 0-d `input_scale` of an NVFP4
    in_proj then fail to load at TP > 1. (Any other group count must be a multiple of vLLM's TP,
    :320-323, whatever the precision: the demo's 2 groups serve at TP <= 2, the 12B's 8 at
    TP <= 8.)"""
    nvfp4_in_proj = any(fmt == "nvfp4" and key.endswith(".mixer.in_proj")
                        for key, fmt in formats.items())
    if cfg.mamba_num_groups == 1 and nvfp4_in_proj:
        return ["model.mamba_num_groups=1: vLLM loads this export's NVFP4 Mamba in_proj at "
                "tensor parallel size 1 only (vLLM 0.33.0 mamba_mixer2.py:456-467); for TP > 1 "
                "train with ++precision.overrides={*.mixer.in_proj:bf16}"]
    return []


def serving_export(fmt: str, dense: Mapping[str, torch.Tensor], packed: Mapping[str, PackedLinear],
                   inputs: Optional[Mapping[str, tuple[torch.Tensor, torch.Tensor]]],
                   bf16_linears: list[str],
                   mxfp8: Optional[Mapping[str, MXFP8Linear]] = None) -> ServingExport:
    """The tensors and configs of one format. `dense`: the BF16 export's state dict (to_hf);
    `inputs`: None for a weight-only (W4A16) export; a packed linear missing from it is
    exported weights-only (compressed-tensors only: HFError for ModelOpt). `mxfp8`: the MXFP8
    linears to write as compressed-tensors' mxfp8-quantized (HFError for ModelOpt, whose
    export writes them in BF16: leave them out and list them in `bf16_linears`)."""
    mxfp8 = dict(mxfp8 or {})
    weights_only = [] if inputs is None else sorted(m for m in packed if m not in inputs)
    if weights_only and fmt != "compressed-tensors":
        raise HFError(f"{weights_only[0]}: a weights-only linear cannot be written in {fmt}'s "
                      "quant_algo NVFP4 (every quantized linear has an input_scale); use "
                      "--format compressed-tensors")
    if mxfp8 and fmt != "compressed-tensors":
        raise HFError(f"{min(mxfp8)}: an MXFP8 linear cannot be written in {fmt}'s quant_algo "
                      "NVFP4; this export writes it in BF16 there")
    quantized = {*packed, *mxfp8}
    dense = split_experts(dense)  # one module per routed expert, as vLLM's nemotron_h loads them
    tensors = {k: v for k, v in dense.items()
               if not (k.endswith(".weight") and k[: -len(".weight")] in quantized)}
    for module, m in mxfp8.items():
        tensors[f"{module}.weight"] = m.weight
        tensors[f"{module}.weight_scale"] = m.scale
    for module, p in packed.items():  # (q/k/v_proj share their scales: one tensor each)
        has_input = inputs is not None and module in inputs
        if fmt == "compressed-tensors":
            tensors[f"{module}.weight_packed"] = p.packed
            tensors[f"{module}.weight_scale"] = p.scales
            tensors[f"{module}.weight_global_scale"] = p.s_enc.reshape(1).clone()
            if has_input:
                tensors[f"{module}.input_global_scale"] = inputs[module][0].reshape(1).clone()
        else:
            tensors[f"{module}.weight"] = p.packed
            tensors[f"{module}.weight_scale"] = p.scales
            tensors[f"{module}.weight_scale_2"] = p.s_dec.reshape(()).clone()
            tensors[f"{module}.input_scale"] = inputs[module][1].reshape(()).clone()
    if fmt == "compressed-tensors":
        w4a4 = sorted(m for m in packed if m not in weights_only)
        if mxfp8:  # every group names its modules (module docstring)
            split = (w4a4, weights_only) if inputs is not None else ([], sorted(packed))
        else:
            split = (w4a4, weights_only) if weights_only else None
        config = compressed_tensors_config(bf16_linears, inputs is not None, split,
                                           sorted(mxfp8))
        return ServingExport(tensors, config, bf16_linears=bf16_linears,
                             weights_only=weights_only)
    quant = modelopt_quant_config(bf16_linears)
    return ServingExport(tensors, modelopt_config_json(quant), {"hf_quant_config.json": quant},
                         bf16_linears=bf16_linears)


def compressed_tensors_config(ignore: list[str], activations: bool,
                              split: Optional[tuple[list[str], list[str]]] = None,
                              mxfp8: list[str] = ()) -> dict:
    """config.json's quantization_config, as compressed-tensors 0.20.1 writes the NVFP4 (W4A4)
    or NVFP4A16 (weight-only) preset. `split` = (W4A4 modules, weights-only modules): the two
    presets side by side, each group targeting its modules by name (module docstring: a
    "Linear" target would take vLLM's fused qkv_proj before its q/k/v names). `mxfp8`: the
    modules of the MXFP8 preset's group (format mxfp8-quantized; `split` then names the NVFP4
    modules, and the model's format is "mixed-precision" where both kinds are present)."""
    def args(**extra):
        return {"num_bits": 4, "type": "float", "symmetric": True, "group_size": BLOCK,
                "strategy": "tensor_group", "scale_dtype": "torch.float8_e4m3fn", **extra}

    def group(targets, with_inputs):
        return {"targets": targets, "weights": args(dynamic=False),
                "input_activations": (args(dynamic="local", observer="static_minmax")
                                      if with_inputs else None),
                "output_activations": None, "format": "nvfp4-pack-quantized"}

    def mx_args(dynamic):  # the MXFP8 preset's (quantization/quant_scheme.py:315-336)
        return {"num_bits": 8, "type": "float", "symmetric": True, "group_size": MX_BLOCK,
                "strategy": "group", "dynamic": dynamic, "scale_dtype": "torch.uint8"}

    if split is None:
        groups = {"group_0": group(["Linear"], activations)}
    else:  # an empty W4A4 side (every NVFP4 linear weights-only) is left out
        groups = {name: group(with_expert_patterns(targets), with_inputs)
                  for name, targets, with_inputs in
                  (("group_0", split[0], True), ("group_1", split[1], False)) if targets}
    if mxfp8:  # the next group number
        index = 1 + max((int(name.rsplit("_", 1)[1]) for name in groups), default=-1)
        groups[f"group_{index}"] = {"targets": sorted(mxfp8), "weights": mx_args(False),
                             "input_activations": mx_args(True), "output_activations": None,
                             "format": MXFP8_FORMAT}
    formats = {g["format"] for g in groups.values()}
    fmt = formats.pop() if len(formats) == 1 else "mixed-precision"
    return {"version": COMPRESSED_TENSORS_VERSION, "quant_method": "compressed-tensors",
            "sparsity_config": {}, "transform_config": {},
            "config_groups": groups, "kv_cache_scheme": None,
            "format": fmt, "quantization_status": "compressed",
            "global_compression_ratio": None, "ignore": with_expert_patterns(ignore),
            "moe_sparsity_config": None}


def modelopt_quant_config(exclude: list[str]) -> dict:
    """hf_quant_config.json, as ModelOpt 0.47.0's get_quant_config writes NVFP4 (exact module
    names in exclude_modules, where ModelOpt may shorten runs to wildcards)."""
    return {"producer": dict(PRODUCER),
            "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None,
                             "group_size": BLOCK, "exclude_modules": sorted(exclude)}}


def modelopt_config_json(quant: dict) -> dict:
    """config.json's quantization_config: convert_hf_quant_config_format of hf_quant_config."""
    q = quant["quantization"]
    fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": q["group_size"]}
    return {"config_groups": {"group_0": {"input_activations": dict(fp4), "weights": dict(fp4),
                                          "targets": ["Linear"]}},
            "ignore": list(q["exclude_modules"]), "quant_algo": "NVFP4",
            "producer": dict(quant["producer"]), "quant_method": "modelopt"}


def bits_per_weight(tensors: Mapping[str, torch.Tensor], module: str, fmt: str) -> float:
    """Stored bits per weight of one quantized linear: codes + block scales + tensor scales.
    `fmt`: compressed-tensors or modelopt (NVFP4), or MXFP8_FORMAT."""
    if fmt == MXFP8_FORMAT:
        names = [f"{module}.weight", f"{module}.weight_scale"]
        weights = tensors[names[0]].numel()
    else:
        names = ([f"{module}.weight_packed", f"{module}.weight_scale",
                  f"{module}.weight_global_scale"] if fmt == "compressed-tensors" else
                 [f"{module}.weight", f"{module}.weight_scale", f"{module}.weight_scale_2"])
        weights = tensors[names[0]].numel() * 2
    return 8 * sum(tensors[n].numel() * tensors[n].element_size() for n in names) / weights

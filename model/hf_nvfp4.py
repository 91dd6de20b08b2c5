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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Optional

import torch

from nvfp4_recipe.formats import FP32_MAX
from nvfp4_recipe.nvfp4 import BLOCK, quantize_nvfp4, tensor_scales

from .config import ModelConfig
from .hf import HFError, _in_proj_parts, split_qkv

FORMATS = ("compressed-tensors", "modelopt")
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


@dataclass
class PackedLinear:
    """One transformers linear's NVFP4 weight: codes, per-16 scales, the FP32 tensor scales."""

    packed: torch.Tensor  # uint8 (N, K/2), even column in the low nibble
    scales: torch.Tensor  # float8_e4m3fn (N, K/16)
    s_enc: torch.Tensor  # float32 0-d, 448 * 6 / amax of the whole megatron weight
    s_dec: torch.Tensor  # float32 0-d, 1 / s_enc


@dataclass
class ServingExport:
    """What write_hf_dir writes for a quantized export (names as NemotronHForCausalLM's)."""

    tensors: dict[str, torch.Tensor]
    quantization_config: dict
    extra_files: dict[str, dict] = field(default_factory=dict)
    bf16_linears: list[str] = field(default_factory=list)  # transformers module names
    weights_only: list[str] = field(default_factory=list)  # NVFP4 linears without input scale


def megatron_weight(full: Mapping[str, torch.Tensor], cfg: ModelConfig, index: int,
                    name: str) -> torch.Tensor:
    """The weight of linear `name` of pattern layer `index` as the model holds it (the
    checkpoint stores Mamba's in_proj in its [z, x, B, C, dt] parts)."""
    prefix = f"decoder.layers.{index}.{name}.weight"
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
        parts = HF_MODULES[name]
        if name == "self_attention.linear_qkv":
            split = zip(split_qkv(packed, cfg), split_qkv(scales, cfg))
        else:
            split = [(packed, scales)]
        for hf_name, (p, s) in zip(parts, split):
            out[dst + hf_name] = PackedLinear(p.contiguous(),
                                              s.contiguous().view(torch.float8_e4m3fn),
                                              s_enc.float(), s_dec.float())
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
    return [f"model.layers.{index}.{m}" for m in HF_MODULES[name]]


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


def bf16_linear_names(cfg: ModelConfig, formats: Mapping[str, str]) -> list[str]:
    """The transformers linears that stay BF16: lm_head and every linear not trained in NVFP4."""
    names = ["lm_head"]
    for key, fmt in formats.items():
        if fmt != "nvfp4":
            _, index, name = key.split(".", 2)
            names += [f"model.layers.{index}.{m}" for m in HF_MODULES[name]]
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
                   bf16_linears: list[str]) -> ServingExport:
    """The tensors and configs of one format. `dense`: the BF16 export's state dict (to_hf);
    `inputs`: None for a weight-only (W4A16) export; a packed linear missing from it is
    exported weights-only (compressed-tensors only: HFError for ModelOpt)."""
    weights_only = [] if inputs is None else sorted(m for m in packed if m not in inputs)
    if weights_only and fmt != "compressed-tensors":
        raise HFError(f"{weights_only[0]}: a weights-only linear cannot be written in {fmt}'s "
                      "quant_algo NVFP4 (every quantized linear has an input_scale); use "
                      "--format compressed-tensors")
    tensors = {k: v for k, v in dense.items()
               if not (k.endswith(".weight") and k[: -len(".weight")] in packed)}
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
        config = compressed_tensors_config(bf16_linears, inputs is not None,
                                           (w4a4, weights_only) if weights_only else None)
        return ServingExport(tensors, config, bf16_linears=bf16_linears,
                             weights_only=weights_only)
    quant = modelopt_quant_config(bf16_linears)
    return ServingExport(tensors, modelopt_config_json(quant), {"hf_quant_config.json": quant},
                         bf16_linears=bf16_linears)


def compressed_tensors_config(ignore: list[str], activations: bool,
                              split: Optional[tuple[list[str], list[str]]] = None) -> dict:
    """config.json's quantization_config, as compressed-tensors 0.20.1 writes the NVFP4 (W4A4)
    or NVFP4A16 (weight-only) preset. `split` = (W4A4 modules, weights-only modules): the two
    presets side by side, each group targeting its modules by name (module docstring: a
    "Linear" target would take vLLM's fused qkv_proj before its q/k/v names)."""
    def args(**extra):
        return {"num_bits": 4, "type": "float", "symmetric": True, "group_size": BLOCK,
                "strategy": "tensor_group", "scale_dtype": "torch.float8_e4m3fn", **extra}

    def group(targets, with_inputs):
        return {"targets": targets, "weights": args(dynamic=False),
                "input_activations": (args(dynamic="local", observer="static_minmax")
                                      if with_inputs else None),
                "output_activations": None, "format": "nvfp4-pack-quantized"}

    if split is None:
        groups = {"group_0": group(["Linear"], activations)}
    else:  # an empty W4A4 side (every NVFP4 linear weights-only) is left out
        groups = {name: group(targets, with_inputs) for name, targets, with_inputs in
                  (("group_0", split[0], True), ("group_1", split[1], False)) if targets}
    return {"version": COMPRESSED_TENSORS_VERSION, "quant_method": "compressed-tensors",
            "sparsity_config": {}, "transform_config": {},
            "config_groups": groups, "kv_cache_scheme": None,
            "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
            "global_compression_ratio": None, "ignore": sorted(ignore),
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
    """Stored bits per weight of one packed linear: codes + block scales + tensor scales."""
    names = ([f"{module}.weight_packed", f"{module}.weight_scale", f"{module}.weight_global_scale"]
             if fmt == "compressed-tensors" else
             [f"{module}.weight", f"{module}.weight_scale", f"{module}.weight_scale_2"])
    weights = tensors[names[0]].numel() * 2
    return 8 * sum(tensors[n].numel() * tensors[n].element_size() for n in names) / weights

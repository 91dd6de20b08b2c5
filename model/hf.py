"""Hugging Face interoperability: this project's hybrid <-> transformers' `NemotronHForCausalLM`.

    python -m tools.hf_export RUN_DIR [--step N] --output DIR [--tokenizer PATH] [--overwrite]
    train.py model.init_from=/path/to/hf_dir ...      (continued pretraining, any TP/PP)

This module maps the model (configuration and weights) both ways; reading a run's checkpoint for
the export is the run reader's job (training/run_reader.py, for tools/hf_export.py). Export reads
a run's megatron distributed checkpoint (written at any tensor/pipeline layout: every tensor is
stored with its global shape, so torch's checkpoint reader assembles the full tensors on one CPU
process), strips the vocabulary padding, splits the fused projections into transformers' layout
and writes, atomically (a temporary directory renamed into place): config.json,
generation_config.json, model.safetensors (sharded with an index above --max-shard-size) and the
tokenizer files. `AutoModelForCausalLM.from_pretrained(DIR)` loads it
with no custom code. Import checks the directory's config.json field by field against
`model.*`, reads safetensors only (never a pickle), and copies each tensor into the rank's shard
of the freshly built model through megatron's own sharded-state-dict description of it.

The one numerical difference and how the export removes it: transformers' Mamba mixer clamps the
step size from below, `dt = clamp(softplus(dt + dt_bias), min=time_step_limit[0])`
(transformers 5.24.0 models/nemotron_h/modeling_nemotron_h.py:296), with
`time_step_limit = (config.time_step_min, inf)` (:415; the config's own `time_step_limit` field is
not read), time_step_min defaulting to 0.001 (configuration_nemotron_h.py:124). megatron-core and
this project (model/ssd.py) do not clamp. The export writes time_step_min = 5e-324, the smallest
positive double: cast to the float32/bfloat16 dt it is 0, and softplus is >= 0, so the clamp is
the identity. (0.0 itself would make transformers' dt initialisation, math.log(time_step_min) at
modeling_nemotron_h.py:1032-1033, fail whenever a model is built from the config.) The one-token
decode step never clamps (mamba2_selective_state_update, :211-270).

Layouts (megatron checkpoint key -> transformers parameter; i = pattern index):
    embedding.word_embeddings.weight [V_pad, h]      model.embeddings.weight [V, h]
    decoder.layers.i.norm / input_layernorm / pre_mlp_layernorm.weight
                                                     model.layers.i.norm.weight
    ...mixer.in_proj.weight.{z,x,B,C,dt}             model.layers.i.mixer.in_proj.weight (rows
                                                     concatenated in that order)
    ...mixer.conv1d.{weight,bias}.{x,B,C}            ...mixer.conv1d.{weight,bias}
    ...mixer.{dt_bias,A_log,D,norm.weight,out_proj.weight}   the same names
    ...self_attention.linear_qkv.weight: per query group g, [q heads of g, k_g, v_g]
                                                     ...mixer.{q,k,v}_proj.weight
    ...self_attention.linear_proj.weight             ...mixer.o_proj.weight
    ...mlp.linear_fc1 / linear_fc2.weight            ...mixer.up_proj / down_proj.weight
    decoder.final_norm.weight                        model.norm_f.weight
    output_layer.weight [V_pad, h]                   lm_head.weight [V, h]
transformers 5 saves the `model.` prefix as `backbone.` (its conversion_mapping.py renames
`backbone.` -> `model.` on load, as NVIDIA's published checkpoints are named); both are read.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Callable, Mapping, Optional

import torch

from atomic_files import (remove_dead_temporaries, temporary_for, temporary_pattern,
                          writer_is_dead)
from errors import ConfigError, ExitCode

from .config import ModelConfig

log = logging.getLogger("nvfp4_pretrain")

ARCHITECTURE = "NemotronHForCausalLM"
MODEL_TYPE = "nemotron_h"
# transformers' names of the layer kinds (configuration_nemotron_h.py:274-281).
HF_LAYER_TYPES = {"mamba": "linear_attention", "attention": "full_attention", "mlp": "mlp",
                  "moe": "moe"}
HF_SYMBOLS = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E",
              "mamba": "M", "attention": "*"}  # the last two: 5.10.4's names (and earlier)
# See the module docstring: the float32/bfloat16 clamp floor this rounds to is 0.
NO_STEP_SIZE_CLAMP = 5e-324
# The megatron mixer's fixed settings this project builds (model/mamba_mixer.py defaults).
CONV_KERNEL = 4
DT_MAX, DT_INIT_FLOOR = 0.1, 1e-4
# The top-level modules of megatron's hybrid model: their keys are the model's weights.
_MODEL_KEY_PREFIXES = ("embedding.", "decoder.", "output_layer.")
# Weight files that are pickles: never opened.
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Every export writes this file, listing the files it wrote. `--overwrite` replaces only a
# directory that holds it and nothing else: never a run, a user's directory, or a file a user
# added to an export (a model card).
EXPORT_MARKER = "nvfp4_export.json"
EXPORT_FORMAT = "nvfp4-pretrain hf_export"

HF_EXTRA_HINT = "install the Hugging Face extra: pip install -e '.[hf]'"


class HFError(ConfigError):
    """A refused export or import: one line, and the exit code that goes with it (a bad value,
    exit 2, unless it says otherwise: a missing file 3, an unusable checkpoint 6, an output that
    cannot be written 8)."""


# -- config ------------------------------------------------------------------------------------


def _d_inner(cfg: ModelConfig) -> int:
    return cfg.mamba_num_heads * cfg.mamba_head_dim


# ModelConfig field <-> NemotronH config.json key, and the layer kind that has it (None: all).
HF_FIELDS = (
    ("hidden_size", "hidden_size", None),
    ("ffn_hidden_size", "intermediate_size", "mlp"),
    ("num_attention_heads", "num_attention_heads", "attention"),
    ("num_query_groups", "num_key_value_heads", "attention"),
    ("kv_channels", "head_dim", "attention"),
    ("mamba_num_heads", "mamba_num_heads", "mamba"),
    ("mamba_head_dim", "mamba_head_dim", "mamba"),
    ("mamba_state_dim", "ssm_state_size", "mamba"),
    ("mamba_num_groups", "n_groups", "mamba"),
    ("layernorm_epsilon", "layer_norm_epsilon", None),
)
# The ModelConfig fields that shape the weights (the norms' epsilon shapes none).
WEIGHT_SHAPE_FIELDS = ("pattern",) + tuple(ours for ours, _, _ in HF_FIELDS
                                           if ours != "layernorm_epsilon")
# What this project's layers always are: {config.json key: (our value, transformers' default
# where the key is absent, configuration_nemotron_h.py:97-151)}.
FIXED_HF_FIELDS = {
    "conv_kernel": (CONV_KERNEL, 4),
    "mlp_hidden_act": ("relu2", "relu2"),  # megatron's squared_relu (model/build.py)
    "mamba_hidden_act": ("silu", "silu"),
    "use_conv_bias": (True, True),
    "use_bias": (False, False), "mlp_bias": (False, False), "attention_bias": (False, False),
    "mamba_proj_bias": (False, False),
    "tie_word_embeddings": (False, False),
}


def moe_hf_fields(cfg: ModelConfig) -> dict:
    """The NemotronH config.json keys of the model's MoE layers ({} without any). transformers'
    router (NemotronHTopkRouter, modeling_nemotron_h.py:854-892 in 5.24.0) picks the top-k of
    sigmoid scores plus e_score_correction_bias, weighs the chosen experts by their sigmoid
    scores, normalised to sum 1 when norm_topk_prob, times routed_scaling_factor: megatron's
    sigmoid routing (mc 0.16.1 transformer/moe/moe_utils.py:716-729), which normalises when
    top-k > 1 and scales by moe_router_topk_scaling_factor. One expert group (n_group =
    topk_group = 1: every expert eligible) and no latent projection, as this project builds."""
    moe = cfg.moe
    if moe is None:
        return {}
    return {"n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.topk,
            "moe_intermediate_size": moe.ffn_hidden_size,
            "moe_shared_expert_intermediate_size": moe.shared_expert_ffn_hidden_size,
            "routed_scaling_factor": moe.topk_scaling_factor or 1.0,
            "norm_topk_prob": moe.topk > 1, "n_group": 1, "topk_group": 1,
            "moe_latent_size": None}


# transformers' defaults of the MoE keys a config.json may leave out
# (configuration_nemotron_h.py:133-144 in 5.24.0)
MOE_HF_DEFAULTS = {"routed_scaling_factor": 1.0, "norm_topk_prob": True, "n_group": 1,
                   "topk_group": 1, "moe_latent_size": None}


def refuse_unmappable_moe(cfg: ModelConfig, key: str = "model") -> None:
    """HFError for MoE layers transformers' NemotronH cannot represent: softmax scores (its
    router is sigmoid only) or no shared expert (its MoE layer always has one)."""
    moe = cfg.moe
    if moe is None:
        return
    if str(moe.score_function) != "sigmoid":
        raise HFError(f"{key}: model.moe.score_function={moe.score_function}: transformers' "
                      "NemotronH routes with sigmoid scores only, so the model has no Hugging "
                      "Face form")
    if moe.shared_expert_ffn_hidden_size is None:
        raise HFError(f"{key}: model.moe.shared_expert_ffn_hidden_size=null: transformers' "
                      "NemotronH MoE layers always have a shared expert, so the model has no "
                      "Hugging Face form")


def hf_config_fields(cfg: ModelConfig, vocab_size: int, *, eos_token_id: Optional[int],
                     bos_token_id: Optional[int] = None, pad_token_id: Optional[int] = None,
                     dtype: str = "bfloat16") -> dict:
    """The `NemotronHConfig` fields of this model (what config.json says)."""
    refuse_unmappable_moe(cfg, "the Hugging Face export")
    d_inner = _d_inner(cfg)
    return {
        "vocab_size": vocab_size,
        "layers_block_type": [HF_LAYER_TYPES[k] for k in cfg.layer_kinds()],
        **{theirs: getattr(cfg, ours) for ours, theirs, _ in HF_FIELDS},
        **{key: ours for key, (ours, _) in FIXED_HF_FIELDS.items()},
        **moe_hf_fields(cfg),
        # Not read by the mixer (its width is mamba_num_heads x mamba_head_dim,
        # modeling_nemotron_h.py:405); recorded as megatron's expand when it is a whole number.
        "expand": d_inner // cfg.hidden_size if d_inner % cfg.hidden_size == 0 else 2,
        "chunk_size": cfg.mamba_chunk_size,
        "time_step_min": NO_STEP_SIZE_CLAMP,
        "time_step_max": DT_MAX,
        "time_step_floor": DT_INIT_FLOOR,
        "residual_in_fp32": False,
        "max_position_embeddings": cfg.max_sequence_length,
        "initializer_range": cfg.init_method_std,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "dtype": dtype,
    }


def hf_config(cfg: ModelConfig, vocab_size: int, **ids):
    """transformers' `NemotronHConfig` of this model (`ids`: eos/bos/pad token ids, dtype)."""
    from transformers import NemotronHConfig

    config = NemotronHConfig(**hf_config_fields(cfg, vocab_size, **ids))
    config.architectures = [ARCHITECTURE]
    return config


# transformers' NemotronH holds each MoE layer's routed experts as one [experts, out, in] tensor
# per projection; NVIDIA's checkpoints, transformers' save_pretrained and vLLM's nemotron_h store
# one tensor per expert (the nemotron_h conversion mapping, transformers conversion_mapping.py:
# 1783-1798 in 5.24.0).
_EXPERT_STACK = re.compile(r"^(.+\.mixer\.experts)\.(up_proj|down_proj)$")
_EXPERT_STORED = "{experts}.{index}.{proj}.weight"


def split_experts(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` with each expert stack as the per-expert tensors stored."""
    out = {}
    for name, value in tensors.items():
        stack = _EXPERT_STACK.match(name)
        if stack is None:
            out[name] = value
            continue
        for e in range(value.shape[0]):
            out[_EXPERT_STORED.format(experts=stack[1], index=e, proj=stack[2])] = value[e]
    return out


def save_safetensors(directory: Path, tensors: Mapping[str, torch.Tensor],
                     max_shard_size: int | str) -> None:
    """model.safetensors (or shards with model.safetensors.index.json), tensor names as
    transformers 5 saves NemotronH (`model.` as `backbone.`, NVIDIA's published names; one
    tensor per routed expert)."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    named = {("backbone." + k[len("model."):] if k.startswith("model.") else k): v.contiguous()
             for k, v in split_experts(tensors).items()}
    split = split_torch_state_dict_into_shards(named, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        save_file({n: named[n] for n in names}, str(Path(directory) / filename),
                  metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size()
                                                for t in named.values())},
                 "weight_map": split.tensor_to_filename}
        (Path(directory) / "model.safetensors.index.json").write_text(
            json.dumps(index, indent=2, sort_keys=True) + "\n")


def write_config(directory: Path, config, quantization_config: Optional[dict] = None) -> None:
    """config.json as transformers writes it, the layers given as NVIDIA's published configs give
    them: `hybrid_override_pattern` (+ `num_hidden_layers`). transformers' own list has changed
    names across releases ("mamba"/"attention" in 5.10.4, "linear_attention"/"full_attention" in
    5.16.1, no "mlp" in 5.5.4); every release with NemotronH (5.3 on) converts the pattern
    (`_pattern_to_list`, configuration_nemotron_h.py:278-281 in 5.24.0)."""
    config.save_pretrained(directory)
    path = Path(directory) / "config.json"
    fields = json.loads(path.read_text())
    layers = fields.pop("layers_block_type")
    fields.pop("mtp_layers_block_type", None)  # MTP is off (num_nextn_predict_layers = 0)
    fields["hybrid_override_pattern"] = "".join(HF_SYMBOLS[t] for t in layers)
    fields["num_hidden_layers"] = len(layers)
    if quantization_config is not None:  # an NVFP4 serving export (model/hf_nvfp4.py)
        fields["quantization_config"] = quantization_config
    path.write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")


def _hf_pattern(hf: Mapping) -> Optional[str]:
    if isinstance(hf.get("layers_block_type"), list):
        return "".join(HF_SYMBOLS.get(t, "?") for t in hf["layers_block_type"])
    pattern = hf.get("hybrid_override_pattern")
    return pattern if isinstance(pattern, str) else None


def config_mismatches(hf: Mapping, cfg: ModelConfig, vocab_size: Optional[int]) -> list[str]:
    """Every way a NemotronH config.json differs from what this model builds ([] when none).

    `vocab_size`: the model's unpadded vocabulary (None: not known yet, not compared).
    """
    found = []
    if hf.get("model_type") != MODEL_TYPE:
        found.append(f"model_type={hf.get('model_type')!r} is not {MODEL_TYPE!r}")
    pattern = _hf_pattern(hf)
    if pattern != cfg.pattern:
        found.append(f"model.pattern={cfg.pattern!r} but the checkpoint's layers are "
                     f"{pattern!r} (hybrid_override_pattern / layers_block_type)")
    kinds = set(cfg.layer_kinds())
    for ours, theirs, kind in HF_FIELDS:
        if kind is not None and kind not in kinds:
            continue  # a size of a layer kind neither pattern has
        if hf.get(theirs) != getattr(cfg, ours):
            found.append(f"model.{ours}={getattr(cfg, ours)} but {theirs}={hf.get(theirs)}")
    for key, ours in moe_hf_fields(cfg).items():
        theirs = hf.get(key, MOE_HF_DEFAULTS.get(key))
        if theirs != ours:
            found.append(f"the model's MoE layers have {key}={ours!r} (model.moe) but the "
                         f"checkpoint's {theirs!r}")
    if vocab_size is not None and hf.get("vocab_size") != vocab_size:
        found.append(f"the model's vocabulary is {vocab_size} (model.vocab_size, or the "
                     f"data.tokenizer's size when null) but vocab_size={hf.get('vocab_size')}")
    for key, (required, default) in FIXED_HF_FIELDS.items():  # what our layers cannot represent
        if hf.get(key, default) != required:
            found.append(f"{key}={hf.get(key)!r} (this project builds {required!r})")
    return found


def read_hf_config(hf_dir: Path, key: str = "model.init_from") -> dict:
    path = Path(hf_dir) / "config.json"
    if not os.path.lexists(hf_dir):
        raise HFError(f"{key}={hf_dir}: no such directory", ExitCode.MISSING)
    if not Path(hf_dir).is_dir():
        raise HFError(f"{key}={hf_dir}: not a directory (a Hugging Face model directory with "
                      "config.json and *.safetensors)")
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise HFError(f"{key}={hf_dir}: no config.json in it", ExitCode.MISSING) from None
    except ValueError as exc:
        raise HFError(f"{key}={hf_dir}: config.json is not JSON ({exc})") from None


def check_init_from(cfg: ModelConfig, vocab_size: Optional[int] = None) -> dict:
    """model.init_from's config.json against `cfg`, and that it holds safetensors weights.

    Reads config.json and the file list only (cheap: training.config.validate calls it after the pure checks, before
    anything is written; the vocabulary is compared when `vocab_size` is given, by the trainer
    once the data's tokenizer is known, as model.vocab_size may be null). Raises HFError naming
    every mismatching field. Returns the config.json fields.
    """
    hf_dir = Path(cfg.init_from).expanduser()
    if (hf_dir / "config.yaml").is_file() and not (hf_dir / "config.json").exists():
        return {}  # a train.py run directory: training/init_from.py checks and reads it
    hf = read_hf_config(hf_dir)
    refuse_unmappable_moe(cfg, f"model.init_from={hf_dir}")
    problems = config_mismatches(hf, cfg, vocab_size)
    if problems:
        raise HFError(f"model.init_from={hf_dir}: its config.json does not match the model "
                      f"config: {'; '.join(problems)}; set model.* to the checkpoint's values "
                      "(e.g. model=nemotron_h_12b for NVIDIA-Nemotron-Nano-12B-v2-Base)")
    stored = {own_name(k): shape for k, (_, shape) in _weight_files(hf_dir).items()}
    problems = tensor_mismatches(hf_dir, stored)
    if problems:
        raise HFError(f"model.init_from={hf_dir}: its tensors do not fit its config.json: "
                      f"{'; '.join(problems)}")
    return hf


# -- transformers <-> megatron tensors --------------------------------------------------------


def _in_proj_parts(cfg: ModelConfig) -> list[tuple[str, int]]:
    gn = cfg.mamba_num_groups * cfg.mamba_state_dim
    return [("z", _d_inner(cfg)), ("x", _d_inner(cfg)), ("B", gn), ("C", gn),
            ("dt", cfg.mamba_num_heads)]


def _conv_parts(cfg: ModelConfig) -> list[tuple[str, int]]:
    return _in_proj_parts(cfg)[1:4]


_NORM_OF = {"mamba": "norm", "attention": "input_layernorm", "mlp": "pre_mlp_layernorm",
            "moe": "pre_mlp_layernorm"}
# An MoE layer's tensors (megatron's MoELayer; its SequentialMLP checkpoints the experts as one
# [experts, out, in] tensor per linear, mc 0.16.1 transformer/moe/experts.py sharded_state_dict)
# -> transformers' NemotronHMoE's (modeling_nemotron_h.py:810-852: experts.up_proj / down_proj
# [experts, out, in], gate.weight and e_score_correction_bias in FP32, shared_experts.*).
_MOE_NAMES = {"mlp.router.weight": "mixer.gate.weight",
              "mlp.router.expert_bias": "mixer.gate.e_score_correction_bias",
              "mlp.experts.experts.linear_fc1.weight": "mixer.experts.up_proj",
              "mlp.experts.experts.linear_fc2.weight": "mixer.experts.down_proj",
              "mlp.shared_experts.linear_fc1.weight": "mixer.shared_experts.up_proj.weight",
              "mlp.shared_experts.linear_fc2.weight": "mixer.shared_experts.down_proj.weight"}
# transformers keeps these in FP32 whatever the model's dtype (_keep_in_fp32_modules_strict,
# modeling_nemotron_h.py:1106)
_FP32_HF_TENSORS = ("mixer.gate.weight", "mixer.gate.e_score_correction_bias")
# Names Transformer Engine layer specs (GPU runs) give the pre-norms fused into the first linear:
# megatron's TE hybrid spec builds in_proj / linear_qkv / linear_fc1 as
# TELayerNormColumnParallelLinear and leaves the layer's own norm an IdentityOp (mc 0.16.1
# models/mamba/mamba_layer_specs.py:45,61,78; core_v0.19.0 models/hybrid/hybrid_layer_specs.py:99,
# 129,203), and TE's LayerNormLinear registers the norm as `layer_norm_weight` (and
# `layer_norm_bias` for LayerNorm) (TE v2.8 pytorch/module/layernorm_linear.py:1276-1289, v2.18
# :1423-1436). Within a pattern layer: TE name -> portable name.
_TE_NORM_ALIASES = {"mixer.in_proj.layer_norm_weight": "norm.weight",
                    "mixer.in_proj.layer_norm_bias": "norm.bias",
                    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
                    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
                    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
                    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}
_NAMES_IN_SPEC = {"portable": _TE_NORM_ALIASES,
                  "te": {portable: te for te, portable in _TE_NORM_ALIASES.items()}}
LAYER_PREFIX = "decoder.layers."


def spec_key(key: str, spec: str) -> str:
    """A checkpoint key as the `spec` family ("portable" | "te") names it.

    `key` is a model tensor's (`decoder.layers.3.norm.weight`) or anything keyed by one, such as
    the optimizer state megatron stores per parameter (`optimizer.state.exp_avg.<model key>`).
    Only the pre-norms differ between the specs; every other key is returned as it is.
    A pure function of the key: the same table serves the Hugging Face export and a resume on
    the other spec (training/checkpoint.py)."""
    if spec not in _NAMES_IN_SPEC:
        raise ValueError(f"spec={spec!r}: choose portable or te")
    head, found, rest = key.partition(LAYER_PREFIX)
    if not found:
        return key
    index, _, name = rest.partition(".")
    return f"{head}{LAYER_PREFIX}{index}.{_NAMES_IN_SPEC[spec].get(name, name)}"


def canonical_key(key: str) -> str:
    """A checkpoint key in the portable spec's names (see `spec_key`)."""
    return spec_key(key, "portable")


def _qkv_shape(cfg: ModelConfig):
    g, d = cfg.num_query_groups, cfg.kv_channels
    return g, cfg.num_attention_heads // g, d


def split_qkv(qkv: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor,
                                                              torch.Tensor]:
    """megatron's fused linear_qkv rows (per query group g: its q heads, k_g, v_g) -> transformers'
    (q_proj, k_proj, v_proj) rows; any row layout (weights, packed codes, per-row scales)."""
    g, per_group, d = _qkv_shape(cfg)
    rows = qkv.reshape(g, per_group + 2, d, -1)
    h = rows.shape[-1]
    return (rows[:, :per_group].reshape(g * per_group * d, h), rows[:, per_group].reshape(g * d, h),
            rows[:, per_group + 1].reshape(g * d, h))


def to_hf(full: Mapping[str, torch.Tensor], cfg: ModelConfig, vocab_size: int) -> dict:
    """megatron checkpoint tensors (full, TP = PP = 1 shapes, portable names) -> the
    `NemotronHForCausalLM.state_dict()` of the same model (vocabulary padding dropped)."""
    out = {"model.embeddings.weight": full["embedding.word_embeddings.weight"][:vocab_size],
           "model.norm_f.weight": full["decoder.final_norm.weight"],
           "lm_head.weight": full["output_layer.weight"][:vocab_size]}
    for i, kind in enumerate(cfg.layer_kinds()):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[dst + "norm.weight"] = full[f"{src}{_NORM_OF[kind]}.weight"]
        if kind == "mamba":
            m = src + "mixer."
            out[dst + "mixer.in_proj.weight"] = torch.cat(
                [full[f"{m}in_proj.weight.{p}"] for p, _ in _in_proj_parts(cfg)])
            for t in ("weight", "bias"):
                out[f"{dst}mixer.conv1d.{t}"] = torch.cat(
                    [full[f"{m}conv1d.{t}.{p}"] for p, _ in _conv_parts(cfg)])
            for name in ("dt_bias", "A_log", "D", "norm.weight", "out_proj.weight"):
                out[f"{dst}mixer.{name}"] = full[m + name]
        elif kind == "attention":
            q, k, v = split_qkv(full[src + "self_attention.linear_qkv.weight"], cfg)
            out[dst + "mixer.q_proj.weight"] = q
            out[dst + "mixer.k_proj.weight"] = k
            out[dst + "mixer.v_proj.weight"] = v
            out[dst + "mixer.o_proj.weight"] = full[src + "self_attention.linear_proj.weight"]
        elif kind == "moe":
            for ours, theirs in _MOE_NAMES.items():
                if src + ours in full:
                    out[dst + theirs] = full[src + ours]
            if src + "mlp.router.expert_bias" not in full:  # built without the expert bias
                out[dst + "mixer.gate.e_score_correction_bias"] = torch.zeros(cfg.moe.num_experts)
            for name in _FP32_HF_TENSORS:
                out[dst + name] = out[dst + name].float()
        else:
            out[dst + "mixer.up_proj.weight"] = full[src + "mlp.linear_fc1.weight"]
            out[dst + "mixer.down_proj.weight"] = full[src + "mlp.linear_fc2.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def from_hf(key: str, hf: Callable[[str], torch.Tensor], cfg: ModelConfig,
            shape: tuple) -> torch.Tensor:
    """The full megatron tensor of checkpoint `key` (portable name, global `shape`) from the
    transformers tensors `hf(name)` (names as in `to_hf`); the inverse of `to_hf`. Vocabulary
    padding rows are zeros: tokens no tokenizer id reaches."""
    if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        rows = hf("model.embeddings.weight" if key.startswith("embedding") else "lm_head.weight")
        if rows.shape[0] > shape[0]:
            raise HFError(f"the checkpoint's vocabulary ({rows.shape[0]}) is larger than the "
                          f"model's ({shape[0]})")
        return torch.cat([rows, rows.new_zeros(shape[0] - rows.shape[0], *rows.shape[1:])])
    if key == "decoder.final_norm.weight":
        return hf("model.norm_f.weight")
    if not key.startswith("decoder.layers."):
        raise HFError(f"no transformers tensor maps to the model's {key}")
    index, _, rest = key[len("decoder.layers."):].partition(".")
    i, kind = int(index), cfg.layer_kinds()[int(index)]
    dst = f"model.layers.{i}."
    if rest == f"{_NORM_OF[kind]}.weight":
        return hf(dst + "norm.weight")
    if kind == "mamba" and rest.startswith(("mixer.in_proj.weight.", "mixer.conv1d.")):
        base, _, part = rest.rpartition(".")
        parts = _in_proj_parts(cfg) if base == "mixer.in_proj.weight" else _conv_parts(cfg)
        start = 0
        for name, size in parts:
            if name == part:
                return hf(dst + base)[start:start + size]
            start += size
    if kind == "mamba" and rest.startswith("mixer."):
        return hf(dst + rest)
    if kind == "attention" and rest == "self_attention.linear_qkv.weight":
        g, per_group, d = _qkv_shape(cfg)
        q = hf(dst + "mixer.q_proj.weight")
        h = q.shape[-1]
        return torch.cat([q.reshape(g, per_group, d, h),
                          hf(dst + "mixer.k_proj.weight").reshape(g, 1, d, h),
                          hf(dst + "mixer.v_proj.weight").reshape(g, 1, d, h)],
                         dim=1).reshape(-1, h)
    if kind == "moe" and rest in _MOE_NAMES:
        return hf(dst + _MOE_NAMES[rest])
    names = {"self_attention.linear_proj.weight": "mixer.o_proj.weight",
             "mlp.linear_fc1.weight": "mixer.up_proj.weight",
             "mlp.linear_fc2.weight": "mixer.down_proj.weight"}
    if rest in names:
        return hf(dst + names[rest])
    raise HFError(f"no transformers tensor maps to the model's {key}")


# -- the model's own sharded description: full tensors in, this rank's shards out --------------


def _sharded_tensors(module: torch.nn.Module):
    """(state dict with factories applied, the factories) of megatron's sharded state dict."""
    from megatron.core.dist_checkpointing.dict_utils import extract_matching_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory, apply_factories

    sharded = module.sharded_state_dict()
    factories, _ = extract_matching_values(
        sharded, lambda x: isinstance(x, ShardedTensorFactory), return_lists_as_dicts=True)
    apply_factories(sharded)
    return sharded, factories


def load_full_tensors(module: torch.nn.Module, tensor_for: Callable) -> None:
    """Fill `module` (this rank's part of the model, any TP/PP) from full tensors.

    `tensor_for(key, global_shape)` returns the full tensor of a checkpoint key (portable
    names). Each is cut to this rank's slice by the ShardedTensor's own global offset, the fused
    parts merged back by megatron's factories, and the result loaded as
    training/checkpoint.py:load_checkpoint loads a checkpoint (only `_extra_state` may be absent).
    """
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import (ShardedObject, ShardedTensor,
                                                          apply_factory_merges)

    sharded, factories = _sharded_tensors(module)

    @torch.no_grad()
    def local(sh):
        if not isinstance(sh, ShardedTensor):
            return sh
        if sh.flattened_range is not None:
            raise ValueError(f"{sh.key}: flattened shards are not model weights")
        full = tensor_for(canonical_key(sh.key), tuple(sh.global_shape))
        if tuple(full.shape) != tuple(sh.global_shape):
            raise HFError(f"{sh.key}: the checkpoint's tensor has shape {tuple(full.shape)}, the "
                          f"model's {tuple(sh.global_shape)}")
        return full[sh.global_slice()].to(sh.data.dtype).clone()

    loaded = dict_list_map_inplace(local, sharded)
    loaded = apply_factory_merges(loaded, factories)
    loaded = {k: v for k, v in loaded.items() if not isinstance(v, ShardedObject)}
    missing, unexpected = module.load_state_dict(loaded, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"weights do not fit the model: missing {missing}, "
                         f"unexpected {unexpected}")


# -- safetensors directories -------------------------------------------------------------------


def _safe_open():
    try:
        from safetensors import safe_open
    except ImportError:
        raise HFError(f"model.init_from needs safetensors: {HF_EXTRA_HINT}") from None
    return safe_open


def _safetensors_header(hf_dir: Path, name: str) -> dict[str, tuple]:
    """{tensor name: shape} of one safetensors file, from its header alone. safetensors checks,
    on opening, that the header parses and that its offsets cover exactly the file (a truncated
    or extended file raises SafetensorError): that error becomes one line naming the file."""
    from safetensors import SafetensorError

    try:
        with _safe_open()(str(hf_dir / name), framework="pt") as f:
            return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except SafetensorError as exc:
        raise HFError(f"model.init_from={hf_dir}: {name} is truncated or corrupt (safetensors: "
                      f"{str(exc).strip().splitlines()[0] if str(exc).strip() else 'unreadable'})"
                      "; copy or download it again") from None
    except OSError as exc:
        raise HFError(f"model.init_from={hf_dir}: cannot read {name} ({exc.strerror or exc})"
                      ) from None


def _weight_files(hf_dir: Path) -> dict[str, tuple[str, tuple]]:
    """{tensor name as stored: (file, shape)} of a directory's safetensors weights; pickles
    refused.

    Every file's header is read (cheap: no tensor data), so a truncated or corrupt file, or an
    index naming a tensor its file lacks, is refused at start-up."""
    index = hf_dir / "model.safetensors.index.json"
    single = hf_dir / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise HFError(f"model.init_from={hf_dir}: unreadable {index.name} ({exc})") from None
        shapes = {}
        for name in sorted(set(weight_map.values())):
            if not (hf_dir / name).is_file():
                raise HFError(f"model.init_from={hf_dir}: {index.name} lists {name}, which is "
                              "missing", ExitCode.MISSING)
            held = _safetensors_header(hf_dir, name)
            lacking = sorted(t for t, f in weight_map.items() if f == name and t not in held)
            if lacking:
                raise HFError(f"model.init_from={hf_dir}: {index.name} places {lacking[0]}"
                              f"{f' (and {len(lacking) - 1} more)' if len(lacking) > 1 else ''} "
                              f"in {name}, which does not hold it")
            shapes.update({t: held[t] for t, f in weight_map.items() if f == name})
        return {t: (f, shapes[t]) for t, f in weight_map.items()}
    if single.is_file():
        return {key: (single.name, shape)
                for key, shape in _safetensors_header(hf_dir, single.name).items()}
    pickles = sorted(p.name for p in hf_dir.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise HFError(f"model.init_from={hf_dir}: its weights are pickles ({', '.join(pickles)}), "
                      "which are never loaded here (unpickling runs code): convert them to "
                      "safetensors first")
    raise HFError(f"model.init_from={hf_dir}: no model.safetensors or "
                  "model.safetensors.index.json in it", ExitCode.MISSING)


def refuse_non_finite(tensor: torch.Tensor, what: str) -> None:
    """An imported weight holding NaN or Inf is named as it loads, not found as a non-finite
    loss at step 1 with a hint pointing elsewhere."""
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise HFError(f"{what}: {bad} of its {tensor.numel()} values are NaN or Inf; the run "
                      "would diverge at its first step: repair or re-export the checkpoint")


def own_name(stored: str) -> str:
    """A stored tensor name as `NemotronHForCausalLM.state_dict()` names it: transformers 5's
    conversion renames backbone. -> model. on load (conversion_mapping.py)."""
    return "model." + stored[len("backbone."):] if stored.startswith("backbone.") else stored


def _is_mtp(name: str) -> bool:
    # Multi-token-prediction heads (`mtp.*`) are not part of the causal LM: transformers skips
    # them too (modeling_nemotron_h.py:1013).
    return name.startswith("mtp.")


def tensor_mismatches(hf_dir: Path, stored: Mapping[str, tuple]) -> list[str]:
    """What a directory's tensors ({own name: shape}, from the headers) lack, hold in excess or
    shape otherwise than the `NemotronHForCausalLM` its config.json describes, built on the meta
    device (no memory, ~0.1 s at 12B). lm_head may be absent when the embeddings are tied."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    # transformers' own reader: it decodes the values JSON cannot hold (Infinity)
    config = NemotronHConfig.from_json_file(str(hf_dir / "config.json"))
    with torch.device("meta"):
        model_state = NemotronHForCausalLM(config).state_dict()
        stored_meta = {k: torch.empty(tuple(v)) for k, v in stored.items()}
    # compared as stored: one tensor per routed expert (a stack stored whole is split too)
    expected = {k: tuple(v.shape) for k, v in split_experts(model_state).items()}
    stored = {k: tuple(v.shape) for k, v in split_experts(stored_meta).items()}
    optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = sorted(k for k in expected if k not in stored and k not in optional)
    extra = sorted(k for k in stored if k not in expected and not _is_mtp(k))
    shaped = [f"{k} is {list(stored[k])}, not {list(expected[k])}" for k in sorted(expected)
              if k in stored and tuple(stored[k]) != expected[k]]

    def listed(what: str, names: list[str]) -> list[str]:
        more = f" (and {len(names) - 3} more)" if len(names) > 3 else ""
        return [f"{what} {', '.join(names[:3])}{more}"] if names else []

    return listed("no", missing) + listed("tensors no layer has:", extra) + shaped[:3]


class SafetensorsWeights:
    """A directory's tensors by their `NemotronHForCausalLM.state_dict()` names, read lazily;
    tensors of one pattern layer are cached until another layer is read."""

    def __init__(self, hf_dir: Path):
        self.dir = Path(hf_dir)
        self.files = {}
        for stored, (file, _) in _weight_files(self.dir).items():
            self.files[own_name(stored)] = (stored, file)
        self.read: set[str] = set()
        self._cache: dict[str, torch.Tensor] = {}
        self._cache_layer = None

    def __call__(self, name: str) -> torch.Tensor:
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if layer != self._cache_layer:
            self._cache, self._cache_layer = {}, layer
        stack = _EXPERT_STACK.match(name)
        if name not in self.files and stack is not None:  # stored one tensor per expert
            experts = []
            while (part := _EXPERT_STORED.format(experts=stack[1], index=len(experts),
                                                 proj=stack[2])) in self.files:
                experts.append(self(part))
            if experts:
                return torch.stack(experts)
        if name not in self._cache:
            if name not in self.files:
                raise HFError(f"model.init_from={self.dir}: it has no tensor {name}")
            stored, file = self.files[name]
            from safetensors import SafetensorError

            try:
                with _safe_open()(str(self.dir / file), framework="pt") as f:
                    self._cache[name] = f.get_tensor(stored)
            except SafetensorError as exc:  # changed since the start-up check
                raise HFError(f"model.init_from={self.dir}: {file} is truncated or corrupt "
                              f"(safetensors: {str(exc).strip()[:200]})") from None
            refuse_non_finite(self._cache[name], f"model.init_from={self.dir}: {stored} in {file}")
            self.read.add(name)
        return self._cache[name]

    def unread(self) -> list[str]:
        return sorted(n for n in self.files if n not in self.read and not _is_mtp(n))


def _tokenizer_vocab(hf_dir: Path) -> Optional[dict]:
    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)


def load_hf_weights(module: torch.nn.Module, cfg: ModelConfig, vocab_size: int,
                    tokenizer=None) -> None:
    """model.init_from: this rank's part of `module` (freshly built, any TP/PP) from the
    NemotronH directory, after checking its config against `cfg` (and its tokenizer.json, when
    it has one, against the data's `tokenizer`). Raises HFError (exit 2) naming the problem."""
    hf_dir = Path(cfg.init_from).expanduser()
    check_init_from(cfg, vocab_size=cfg.vocab_size or vocab_size)
    if tokenizer is not None:
        theirs = _tokenizer_vocab(hf_dir)
        if theirs is not None and theirs != tokenizer.get_vocab(with_added_tokens=True):
            raise HFError(f"model.init_from={hf_dir}: its tokenizer.json has another vocabulary "
                          "than data.tokenizer: tokenize the data with the checkpoint's "
                          "tokenizer")
    weights = SafetensorsWeights(hf_dir)
    load_full_tensors(module, lambda key, shape: from_hf(key, weights, cfg, shape))
    first, last = module.pre_process, module.post_process
    if first and last and len(getattr(module.decoder, "layers", [])) == cfg.num_layers:
        for i, kind in enumerate(cfg.layer_kinds()):
            if kind == "moe" and not cfg.moe.expert_bias:  # transformers' bias must be zeros
                bias = weights(f"model.layers.{i}.mixer.gate.e_score_correction_bias")
                if bool(bias.any()):
                    raise HFError(f"model.init_from={hf_dir}: layer {i}'s "
                                  "e_score_correction_bias is not zero but model.moe."
                                  "expert_bias=false: set it true to import the bias")
        unread = weights.unread()  # only a rank holding the whole model can tell
        if unread:
            raise HFError(f"model.init_from={hf_dir}: tensors this model has no place for: "
                          f"{', '.join(unread[:5])}{' ...' if len(unread) > 5 else ''}")
    log.info(f"model.init_from: loaded {len(weights.read)} tensors from {hf_dir}")


# -- export ------------------------------------------------------------------------------------


def not_replaceable(directory: Path) -> Optional[str]:
    """Why `directory` (existing, not empty) is not a previous export that may be replaced as a
    whole, or None: it must hold EXPORT_MARKER (a regular file, not a link) and only the files
    that marker lists."""
    marker = Path(directory) / EXPORT_MARKER
    if marker.is_symlink() or not marker.is_file():
        return f"not an export of this project (no {EXPORT_MARKER} in it)"
    try:
        meta = json.loads(marker.read_text())
        listed = set(meta["files"]) if meta.get("format") == EXPORT_FORMAT else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        listed = None
    if listed is None:
        return f"its {EXPORT_MARKER} is not one this project wrote"
    extra = sorted(p.name for p in Path(directory).iterdir()
                   if p.name != EXPORT_MARKER and p.name not in listed)
    if extra:
        return (f"it holds {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}, which the "
                "export did not write")
    return None


def _recover_dead_exports(output: Path) -> None:
    """What an export killed mid-way (SIGKILL, the OOM killer) left beside `output`: its
    unfinished copy goes (a 12B one is ~25 GB); a previous export it had moved aside goes back
    under its name when nothing took that name since, and goes otherwise."""
    remove_dead_temporaries(temporary_pattern(output))
    for old in sorted(glob.glob(temporary_pattern(output, "old"))):
        if not writer_is_dead(old):
            continue
        if not os.path.lexists(output):
            os.replace(old, output)
            log.warning(f"{output}: put back the previous export that a killed export had "
                        f"moved aside ({Path(old).name})")
        else:
            shutil.rmtree(old, ignore_errors=True)


def write_hf_dir(output: Path, config, state_dict: Mapping[str, torch.Tensor], tokenizer,
                 max_shard_size: str | int = "5GB", about: Optional[Mapping] = None,
                 serving=None) -> None:
    """Write the model directory into a temporary sibling and rename it into place.

    `serving` (model/hf_nvfp4.py's ServingExport): an NVFP4 export; its tensors are written in
    place of `state_dict`'s (which still checks every name and shape against the model), with its
    quantization_config in config.json and its extra files (hf_quant_config.json).

    An existing non-empty `output` is replaced only when it is a previous export
    (`not_replaceable`), checked again right before it is moved aside; `about` goes into the
    export's marker file (e.g. the run and checkpoint it came from)."""
    from transformers import GenerationConfig, NemotronHForCausalLM

    output = Path(os.path.realpath(output))  # a link to a directory: what it points at is replaced
    output.parent.mkdir(parents=True, exist_ok=True)
    _recover_dead_exports(output)
    tmp = temporary_for(output)
    try:
        with torch.device("meta"):  # no memory: the weights are assigned below
            model = NemotronHForCausalLM(config)
        model.load_state_dict(dict(state_dict), strict=True, assign=True)
        model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id,
                                                   eos_token_id=config.eos_token_id,
                                                   pad_token_id=config.pad_token_id)
        if serving is None:
            model.save_pretrained(tmp, max_shard_size=max_shard_size)
        else:
            tmp.mkdir()
            save_safetensors(tmp, serving.tensors, max_shard_size)
            model.generation_config.save_pretrained(tmp)
            for name, fields in serving.extra_files.items():
                (tmp / name).write_text(json.dumps(fields, indent=4) + "\n")
        write_config(tmp, config, serving.quantization_config if serving is not None else None)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        files = sorted(p.name for p in tmp.iterdir())
        (tmp / EXPORT_MARKER).write_text(json.dumps(
            {"format": EXPORT_FORMAT, **dict(about or {}), "files": files}, indent=2) + "\n")
        for path in tmp.iterdir():  # safetensors' temporary files are private (0600)
            path.chmod(0o644)
        if output.is_dir() and any(output.iterdir()):
            problem = not_replaceable(output)
            if problem is not None:
                raise HFError(f"--output {output}: {problem}; nothing was replaced")
        if output.exists():  # empty, or --overwrite: the old one goes only once the new is whole
            old = temporary_for(output, "old")
            os.replace(output, old)
            try:
                os.replace(tmp, output)
            except BaseException:
                os.replace(old, output)  # the previous export goes back where it was
                raise
            shutil.rmtree(old, ignore_errors=True)  # the new export is in place: not an error
            if old.exists():
                log.warning(f"the previous export could not be removed completely: what is left "
                            f"of it is in {old}")
        else:
            os.replace(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

"""MXFP8 linears in the serving export (model/hf_nvfp4.py, `tools.hf_export --weights nvfp4|mxfp8`).

A small model with all three layer kinds, its input amax recorded by real forwards, written as a
run directory and exported in this process: under a Nemotron 3 style map (NVFP4 linears, the
Mamba out_proj and the attention QKV in MXFP8) and under precision=mxfp8. The MXFP8 weights are
checked with compressed-tensors' own MXFP8 decompression and vLLM's dequantization formula
(written out from its source) against the emulated Fprop's weight operand, and loaded with
transformers.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the Hugging Face extra: pip install -e '.[hf]'")
pytest.importorskip("compressed_tensors", reason="the Hugging Face extra: pip install -e '.[hf]'")

from hf_helpers import (load_safetensors, saved_key, trained_weights_and_amax,  # noqa: E402
                        write_export_run)
from model import hf, hf_nvfp4  # noqa: E402
from model.build import precision_policy  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from nvfp4_recipe.mxfp8 import mxfp8_dequantized_values  # noqa: E402
from nvfp4_recipe.policy import PrecisionConfig  # noqa: E402
from tools import hf_export  # noqa: E402

# Every linear a whole number of 32-blocks (as MXFP8 training needs) and 16x16 tiles: in_proj
# has 2 x 128 + 2 x 2 x 16 + 32 = 352 rows.
TINY = ModelConfig(pattern="M-*M-", hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                   num_query_groups=2, kv_channels=16, mamba_num_heads=32, mamba_head_dim=4,
                   mamba_state_dim=16, mamba_num_groups=2, mamba_chunk_size=16, vocab_size=300,
                   spec="portable")
VOCAB = 300
# Layers 1-3 NVFP4 (first and last BF16), with the Nemotron 3 map's MXFP8 Mamba out_proj (layer
# 3) and, for the q/k/v split, layer 2's attention QKV in MXFP8.
MIXED = PrecisionConfig(name="nvfp4_mixed", format="nvfp4", bf16_first_layers=1,
                        bf16_last_layers=1, gemm="exact", kernels="eager",
                        overrides={"layers.3.mixer.out_proj": "mxfp8",
                                   "layers.2.self_attention.linear_qkv": "mxfp8"})
MXFP8 = PrecisionConfig(name="mxfp8", format="mxfp8", bf16_first_layers=0, bf16_last_layers=0,
                        gemm="exact")
MXFP8_MODULES = ["model.layers.2.mixer.k_proj", "model.layers.2.mixer.q_proj",
                 "model.layers.2.mixer.v_proj", "model.layers.3.mixer.out_proj"]
NVFP4_MODULES = ["model.layers.1.mixer.down_proj", "model.layers.1.mixer.up_proj",
                 "model.layers.2.mixer.o_proj", "model.layers.3.mixer.in_proj"]


@pytest.fixture(scope="module")
def trained(parallel_context):
    """(BF16 checkpoint tensors, the input-amax recorder's state after two steps of forwards of
    the MIXED model)."""
    from transformers import NemotronHForCausalLM  # noqa: F401  (its import-time warnings)

    return trained_weights_and_amax(TINY, MIXED, VOCAB)


def write_run(root: Path, tokenizer: str, weights, amax_state, prec: PrecisionConfig,
              monkeypatch) -> Path:
    return write_export_run(root, TINY, tokenizer, weights, amax_state, prec, monkeypatch)


def forward_operands(weights, prec: PrecisionConfig) -> dict[str, torch.Tensor]:
    """{transformers module: BF16 values} of the MXFP8 linears' weight operand in the emulated
    Fprop (operands.py's _MXFP8Ops.weight_fprop: the BF16 weight, 1x32 blocks along K), split
    as the export splits it."""
    out = {}
    for key, fmt in precision_policy(TINY, prec).linear_formats().items():
        if fmt != "mxfp8":
            continue
        _, index, name = key.split(".", 2)
        w = hf_nvfp4.megatron_weight(weights, TINY, int(index), name).to(torch.bfloat16)
        values = mxfp8_dequantized_values(w, torch.bfloat16)
        rows = hf.split_qkv(values, TINY) if name.endswith("linear_qkv") else (values,)
        for hf_name, v in zip(hf_nvfp4.HF_MODULES[name], rows):
            out[f"model.layers.{index}.{hf_name}"] = v
    return out


@pytest.fixture
def export(tmp_path, monkeypatch, tiny_tokenizer, trained, caplog):
    """export(prec, *args) -> (bf16 dir, quantized dir, the export's log lines)."""
    weights, amax = trained

    def make(prec: PrecisionConfig, *args: str):
        root = tmp_path / f"{prec.name}-{'-'.join(a.strip('-') for a in args)}"
        run = write_run(root, tiny_tokenizer, weights, amax, prec, monkeypatch)
        bf16_dir, out = root / "bf16", root / "out"
        assert hf_export.main([str(run), "--output", str(bf16_dir)]) == 0
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="nvfp4_pretrain"):
            assert hf_export.main([str(run), "--output", str(out), *args]) == 0
        return bf16_dir, out, [r.getMessage() for r in caplog.records]

    return make


def vllm_dequant_mxfp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """vLLM 0.33.0's dequant_mxfp8_to_bf16 (quantization/utils/mxfp8_utils.py:230-243), written
    out: x.float() in blocks of 32 times exp2(scale - 127), then BF16."""
    x = weight.to(torch.float32)
    blocks = x.view(*x.shape[:-1], x.shape[-1] // 32, 32)
    descale = torch.exp2(scale.to(torch.float32) - 127.0)
    return (blocks * descale.unsqueeze(-1)).view(x.shape).to(torch.bfloat16)


def vllm_is_mxfp8(args: dict) -> bool:
    """vLLM 0.33.0's CompressedTensorsConfig._is_mxfp8 (compressed_tensors.py:491-510) on the
    weight args as its QuantizationArgs.model_validate reads them."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy

    q = QuantizationArgs.model_validate(args)
    return (q.strategy == QuantizationStrategy.GROUP.value and q.symmetric
            and q.group_size == 32 and q.type == "float" and q.num_bits == 8
            and q.scale_dtype == torch.uint8)


def test_compressed_tensors_writes_the_mxfp8_linears_as_the_forward_operand(export, trained):
    """--weights nvfp4 of a run with MXFP8 linears: their E4M3 codes and E8M0 exponents decode,
    by compressed-tensors' own MXFP8 decompression and by vLLM's formula, to the emulated
    Fprop's weight operand bit for bit; the config gives them the MXFP8 preset's group by name,
    the NVFP4 linears theirs, and only the BF16 linears are ignored; the export says so."""
    from compressed_tensors.compressors.mxfp8.base import MXFP8QuantizationCompressor
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationScheme,
                                                 preset_name_to_scheme)

    weights, _ = trained
    bf16_dir, out, log = export(MIXED, "--weights", "nvfp4")
    tensors, dense = load_safetensors(out), load_safetensors(bf16_dir)
    operands = forward_operands(weights, MIXED)
    assert sorted(operands) == MXFP8_MODULES
    scheme = QuantizationScheme(targets=["Linear"], **preset_name_to_scheme("MXFP8", ["Linear"])
                                .model_dump(exclude={"targets"}))
    for module, values in operands.items():
        name = saved_key(module)
        weight, scale = tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"]
        n, k = values.shape
        assert weight.dtype == torch.float8_e4m3fn and weight.shape == (n, k), module
        assert scale.dtype == torch.uint8 and scale.shape == (n, k // 32), module
        assert not [key for key in tensors if key.startswith(name + ".") and
                    key not in (f"{name}.weight", f"{name}.weight_scale")], module
        lib = MXFP8QuantizationCompressor.decompress({"weight": weight, "weight_scale": scale},
                                                     scheme)["weight"]
        assert lib.dtype == torch.bfloat16 and torch.equal(lib, values), module
        assert torch.equal(vllm_dequant_mxfp8(weight, scale), values), module
        stored = {f"{module}.{p}": tensors[f"{name}.{p}"] for p in ("weight", "weight_scale")}
        assert hf_nvfp4.bits_per_weight(stored, module, hf_nvfp4.MXFP8_FORMAT) == 8 + 8 / 32
    for module in NVFP4_MODULES:  # the NVFP4 linears as before
        assert tensors[f"{saved_key(module)}.weight_packed"].dtype == torch.uint8, module
        assert f"{saved_key(module)}.input_global_scale" in tensors, module
    # Every BF16 tensor is the BF16 export's.
    quantized = {saved_key(m) for m in (*MXFP8_MODULES, *NVFP4_MODULES)}
    for key, tensor in dense.items():
        if key.removesuffix(".weight") not in quantized:
            assert torch.equal(tensors[key], tensor), key

    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["format"] == "mixed-precision"
    groups = config["config_groups"]
    assert groups["group_0"]["targets"] == NVFP4_MODULES  # by name: no "Linear" next to MXFP8
    assert groups["group_0"]["format"] == "nvfp4-pack-quantized"
    mx = groups["group_1"]
    assert mx["targets"] == MXFP8_MODULES and mx["format"] == "mxfp8-quantized"
    preset = preset_name_to_scheme("MXFP8", ["x"]).model_dump()
    for part in ("weights", "input_activations"):
        lib_args = {k: (str(v) if k == "scale_dtype" else v) for k, v in preset[part].items()}
        assert mx[part] == lib_args, part
    assert vllm_is_mxfp8(mx["weights"]) and not vllm_is_mxfp8(groups["group_0"]["weights"])
    assert config["ignore"] == sorted(["lm_head", "model.layers.0.mixer.in_proj",
                                       "model.layers.0.mixer.out_proj",
                                       "model.layers.4.mixer.down_proj",
                                       "model.layers.4.mixer.up_proj"])
    # compressed-tensors reads the config: MXFP8 scales for the MXFP8 group only.
    parsed = QuantizationConfig.model_validate(config)
    assert parsed.config_groups["group_1"].format == "mxfp8-quantized"
    # What the export says: its log and its metadata.
    about = json.loads((out / "nvfp4_export.json").read_text())
    assert about["weights"] == "nvfp4" and about["format"] == "compressed-tensors"
    assert about["mxfp8_linears"] == {"written_as": "mxfp8-quantized", "modules": MXFP8_MODULES}
    (line,) = [m for m in log if "MXFP8 linears" in m]
    assert line.startswith("4 MXFP8 linears written as compressed-tensors mxfp8-quantized")


@torch._dynamo.config.patch(disable=True)
def test_transformers_loads_an_mxfp8_export_to_the_forward_weights(export, trained):
    """transformers with compressed-tensors loads a --weights mxfp8 export decompressed (its one
    group: compressors/mxfp8/base.py's decompression): every linear's weight is the emulated
    Fprop's operand, bit for bit. (A mixed NVFP4 + MXFP8 export it cannot: transformers 5.24
    decompresses every dense module with one group's scheme, integrations/compressed_tensors.py
    :45-53, 90-91; docs/serving.md.)"""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    weights, _ = trained
    _, out, _ = export(MXFP8, "--weights", "mxfp8")
    model = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.bfloat16, quantization_config=CompressedTensorsConfig(dequantize=True))
    loaded = dict(model.named_parameters())
    operands = forward_operands(weights, MXFP8)
    assert len(operands) == 12
    for module, values in operands.items():
        assert torch.equal(loaded[f"{module}.weight"], values), module
    with torch.no_grad():
        logits = model(torch.randint(0, VOCAB, (1, 16))).logits
    assert torch.isfinite(logits).all()


def test_modelopt_export_writes_the_mxfp8_linears_in_bf16_and_says_so(export):
    """ModelOpt's quant_algo NVFP4 names one algorithm for the model: the MXFP8 linears are the
    BF16 export's tensors, listed in exclude_modules, and the log and metadata say so."""
    bf16_dir, out, log = export(MIXED, "--weights", "nvfp4", "--format", "modelopt")
    tensors, dense = load_safetensors(out), load_safetensors(bf16_dir)
    for module in MXFP8_MODULES:
        key = f"{saved_key(module)}.weight"
        assert tensors[key].dtype == torch.bfloat16 and torch.equal(tensors[key], dense[key])
        assert f"{saved_key(module)}.weight_scale" not in tensors
    quant = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert set(MXFP8_MODULES) <= set(quant["exclude_modules"])
    about = json.loads((out / "nvfp4_export.json").read_text())
    assert about["mxfp8_linears"] == {"written_as": "bf16", "modules": MXFP8_MODULES}
    (line,) = [m for m in log if "MXFP8 linears" in m]
    assert line.startswith("warning: 4 MXFP8 linears written in BF16")


def test_an_mxfp8_run_exports_with_weights_mxfp8(export, trained):
    """precision=mxfp8 (every linear MXFP8): --weights mxfp8 writes one MXFP8 group naming every
    linear (no NVFP4, no input scales, no recorded amax needed)."""
    weights, _ = trained
    _, out, _ = export(MXFP8, "--weights", "mxfp8")
    tensors = load_safetensors(out)
    operands = forward_operands(weights, MXFP8)
    assert len(operands) == 2 * 2 + 2 * 2 + (1 + 3)  # 2 Mamba, 2 MLP, 1 attention (q/k/v + o)
    for module, values in operands.items():
        name = saved_key(module)
        assert torch.equal(vllm_dequant_mxfp8(tensors[f"{name}.weight"],
                                              tensors[f"{name}.weight_scale"]), values), module
    assert not [k for k in tensors if "global_scale" in k or "input" in k]
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["format"] == "mxfp8-quantized" and list(config["config_groups"]) == ["group_0"]
    assert config["config_groups"]["group_0"]["targets"] == sorted(operands)
    assert config["ignore"] == ["lm_head"]
    about = json.loads((out / "nvfp4_export.json").read_text())
    assert about["weights"] == "mxfp8" and "input_amax_steps" not in about
    assert about["mxfp8_linears"]["written_as"] == "mxfp8-quantized"


def test_mxfp8_refusals_are_one_line_before_anything_is_written(tmp_path, monkeypatch, capsys,
                                                                tiny_tokenizer, trained):
    weights, amax = trained

    def refused(prec, *args, text):
        run = write_run(tmp_path / f"r{len(list(tmp_path.iterdir()))}", tiny_tokenizer, weights,
                        amax, prec, monkeypatch)
        out = run.parent / "out"
        assert hf_export.main([str(run), "--output", str(out), *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and text in err[0], err
        assert not out.exists()

    refused(MXFP8, "--weights", "nvfp4", text="never trained a linear in NVFP4 (its forward; "
            "precision.format=mxfp8): use --weights bf16 (its MXFP8 linears: --weights mxfp8)")
    refused(MIXED, "--weights", "mxfp8", text="--weights nvfp4 writes both")
    refused(MXFP8, "--weights", "mxfp8", "--format", "modelopt",
            text="does not write ModelOpt's MXFP8")
    refused(MXFP8, "--weights", "mxfp8", "--weights-only", text="no input scales to leave out")
    refused(MXFP8, "--weights", "mxfp8", "--zero-amax", "weights-only",
            text="applies to --weights nvfp4 with input scales only")
    bf16 = PrecisionConfig(name="bf16", format="bf16")
    refused(bf16, "--weights", "mxfp8", text="never trained a linear in MXFP8")


def test_a_linear_exports_in_the_format_its_forward_ran_in():
    """With a format per pass the export writes the forward's weights: an MXFP8 Fprop with NVFP4
    backward GEMMs is an MXFP8 linear, a BF16 Fprop a BF16 one, whatever its backward ran in."""
    from nvfp4_recipe.passes import PassFormats

    formats = {"layers.1.mixer.out_proj": PassFormats("mxfp8", "nvfp4", "nvfp4"),
               "layers.1.mixer.in_proj": PassFormats("bf16", "nvfp4", "nvfp4"),
               "layers.2.mlp.linear_fc1": PassFormats("nvfp4"), "layers.2.mlp.linear_fc2": "bf16"}
    assert hf_nvfp4.forward_formats(formats) == {
        "layers.1.mixer.out_proj": "mxfp8", "layers.1.mixer.in_proj": "bf16",
        "layers.2.mlp.linear_fc1": "nvfp4", "layers.2.mlp.linear_fc2": "bf16"}
    assert hf_nvfp4.bf16_linear_names(TINY, formats, ("nvfp4", "mxfp8")) == [
        "lm_head", "model.layers.1.mixer.in_proj", "model.layers.2.mixer.down_proj"]

"""NVFP4 serving exports (model/hf_nvfp4.py, `tools.hf_export --weights nvfp4`).

A small NVFP4 model (all three layer kinds, a BF16 first and last layer, an override kept
BF16) whose input amax is recorded by a real forward, written as a run directory; the export runs
end to end in this process and is checked with compressed-tensors' own decompression, the
ModelOpt dequantization formula, transformers' loader and the project's quantizer.
A TP=2 NVFP4 demo run, exported in both formats, resumed with its amax window:
tests/system/test_hf_runs.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the Hugging Face extra: pip install -e '.[hf]'")

from hf_helpers import (load_safetensors, saved_key, trained_weights_and_amax,  # noqa: E402
                        write_export_run)
from model import hf, hf_nvfp4  # noqa: E402
from model.build import build_model, precision_policy  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from nvfp4_recipe.megatron.input_amax import running_input_amax  # noqa: E402
from nvfp4_recipe.nvfp4 import nvfp4_scaled_values, quantize_nvfp4, tensor_scales  # noqa: E402
from nvfp4_recipe.policy import PrecisionConfig  # noqa: E402
from tools import hf_export  # noqa: E402

# Every linear a whole number of 16x16 tiles (as NVFP4 training requires): in_proj has
# 2 x 128 + 2 x 2 x 16 + 16 = 336 rows.
TINY = ModelConfig(pattern="M-*M-", hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                   num_query_groups=2, kv_channels=16, mamba_num_heads=16, mamba_head_dim=8,
                   mamba_state_dim=16, mamba_num_groups=2, mamba_chunk_size=16, vocab_size=300,
                   spec="portable")
VOCAB = 300
# Layers 1-3 NVFP4 (first 1 and last 1 BF16), layer 3's out_proj kept BF16 by an override.
OVERRIDE = "layers.3.mixer.out_proj"


def precision(weight_2d: bool = True, **kw) -> PrecisionConfig:
    return PrecisionConfig(name="nvfp4", format="nvfp4", weight_2d=weight_2d, bf16_first_layers=1,
                           bf16_last_layers=1, overrides={OVERRIDE: "bf16"}, gemm="exact",
                           kernels="eager", **kw)


def nvfp4_linears(prec: PrecisionConfig) -> dict[str, str]:
    return precision_policy(TINY, prec).linear_formats()


@pytest.fixture(scope="module")
def trained(parallel_context):
    """(BF16 checkpoint tensors, the recorder's state after two steps of forwards)."""
    from transformers import NemotronHForCausalLM  # noqa: F401  (its import-time warnings)

    return trained_weights_and_amax(TINY, precision(), VOCAB)


def write_run(root: Path, tokenizer: str, weights, amax_state, prec: PrecisionConfig,
              monkeypatch) -> Path:
    return write_export_run(root, TINY, tokenizer, weights, amax_state, prec, monkeypatch)


def forward_operands(weights, prec: PrecisionConfig) -> dict[str, tuple]:
    """{transformers module: (q*s FP32 rows, S_dec)}: the weight operand of the emulated Fprop
    (nvfp4_recipe.linear's weight_fprop: nvfp4_scaled_values of the BF16 weight), split as the
    export splits it."""
    tile = 16 if prec.weight_2d else 1
    out = {}
    for key, fmt in nvfp4_linears(prec).items():
        if fmt != "nvfp4":
            continue
        _, index, name = key.split(".", 2)
        w = hf_nvfp4.megatron_weight(weights, TINY, int(index), name).to(torch.bfloat16)
        values, s_dec = nvfp4_scaled_values(w, tile, dtype=torch.float32, kernels="eager")
        rows = hf.split_qkv(values, TINY) if name.endswith("linear_qkv") else (values,)
        for hf_name, v in zip(hf_nvfp4.HF_MODULES[name], rows):
            out[f"model.layers.{index}.{hf_name}"] = (v, s_dec)
    return out


def policy_key(module: str) -> str:
    """transformers module (model.layers.2.mixer.q_proj) -> its megatron linear's policy name."""
    _, _, index, hf_name = module.split(".", 3)
    return next(f"layers.{index}.{mg}" for mg, names in hf_nvfp4.HF_MODULES.items()
                if hf_name in names)


@pytest.fixture
def exports(tmp_path, monkeypatch, tiny_tokenizer, trained):
    """Export the run as bf16 and nvfp4 in `fmt` with `weight_2d`; returns the directories."""
    weights, amax = trained

    def make(fmt: str, weight_2d: bool = True, weights_only: bool = False):
        prec = precision(weight_2d)
        run = write_run(tmp_path / f"{fmt}-{weight_2d}", tiny_tokenizer, weights, amax, prec,
                        monkeypatch)
        bf16_dir, nvfp4_dir = run.parent / "bf16", run.parent / "nvfp4"
        assert hf_export.main([str(run), "--output", str(bf16_dir)]) == 0
        args = [str(run), "--output", str(nvfp4_dir), "--weights", "nvfp4", "--format", fmt]
        assert hf_export.main(args + (["--weights-only"] if weights_only else [])) == 0
        return prec, bf16_dir, nvfp4_dir

    return make


@pytest.mark.parametrize("weight_2d", [True, False], ids=["16x16", "1x16"])
def test_compressed_tensors_decompresses_to_the_forward_operands(exports, trained, weight_2d):
    """compressed-tensors' own unpacking and scales reproduce, bit for bit, the q*s operand the
    emulated Fprop multiplied, and S_dec = 1 / weight_global_scale; its dequantization
    (q * (s / global_scale), then BF16) equals the project's (q * s) * S_dec rounded to BF16 up
    to the one FP32 rounding its division adds."""
    pytest.importorskip("compressed_tensors", reason="the Hugging Face extra: pip install -e '.[hf]'")
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4

    weights, amax_state = trained
    prec, bf16_dir, out = exports("compressed-tensors", weight_2d)
    tensors, dense = load_safetensors(out), load_safetensors(bf16_dir)
    operands = forward_operands(weights, prec)
    amax, steps = running_input_amax(amax_state)
    assert steps == 2 and set(amax) == {k for k, f in nvfp4_linears(prec).items() if f == "nvfp4"}
    scheme = QuantizationScheme(targets=["Linear"], **NVFP4)
    bf16_ulp_diffs = 0
    for module, (values, s_dec) in operands.items():
        name = saved_key(module)
        packed = tensors[f"{name}.weight_packed"]
        scale = tensors[f"{name}.weight_scale"]
        glob = tensors[f"{name}.weight_global_scale"]
        assert packed.dtype == torch.uint8 and scale.dtype == torch.float8_e4m3fn
        assert glob.dtype == torch.float32 and glob.shape == (1,)
        n, k = values.shape
        assert packed.shape == (n, k // 2) and scale.shape == (n, k // 16)
        # The codes and scales the library reads are the forward's: q * s bit for bit.
        q = unpack_fp4_from_uint8(packed, n, k, dtype=torch.float32)
        lib_values = (q.view(n, k // 16, 16) * scale.float().unsqueeze(-1)).view(n, k)
        assert torch.equal(lib_values, values), module
        assert torch.equal(torch.div(1.0, glob[0]), s_dec), module  # encode direction
        # input_global_scale: S_enc of the recorded running input amax.
        want = tensor_scales(torch.tensor(amax[policy_key(module)]))[0]
        assert torch.equal(tensors[f"{name}.input_global_scale"], want.reshape(1)), module
        # The library's whole decompression against the project's dequantization.
        lib = NVFP4PackedCompressor.decompress(
            {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": glob},
            scheme)["weight"]
        ours = (values * s_dec).to(torch.bfloat16)
        assert lib.dtype == torch.bfloat16
        ulps = (lib.view(torch.int16).int() - ours.view(torch.int16).int()).abs()
        ulps[lib == ours] = 0  # -0.0 (code 8) == +0.0
        assert ulps.max() <= 1, module
        bf16_ulp_diffs += int((ulps > 0).sum())
    # The two roundings can differ at a BF16 rounding tie; measured: 0 of 50,176 weights.
    total = sum(v.numel() for v, _ in operands.values())
    assert bf16_ulp_diffs <= total * 1e-3, (bf16_ulp_diffs, total)

    # Every BF16 tensor is the BF16 export's; the ignore list is exactly the BF16 linears.
    packed_names = {saved_key(m) for m in operands}
    for name, tensor in dense.items():
        if name.removesuffix(".weight") not in packed_names:
            assert torch.equal(tensors[name], tensor), name
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    bf16 = ["lm_head", "model.layers.0.mixer.in_proj", "model.layers.0.mixer.out_proj",
            "model.layers.3.mixer.out_proj", "model.layers.4.mixer.down_proj",
            "model.layers.4.mixer.up_proj"]
    assert config["ignore"] == sorted(bf16)
    assert config["format"] == "nvfp4-pack-quantized" and config["quant_method"] == "compressed-tensors"


def test_the_packed_linears_are_4_5_bits_per_weight_on_disk(exports):
    """Measured from the files: uint8 codes (4 bits) + an E4M3 scale per 16 (0.5 bit) + one FP32
    global scale; not FP8 tensors (ModelOpt issue #868 wrote NVFP4 at 6.1 bits per weight)."""
    from safetensors import safe_open

    for fmt in hf_nvfp4.FORMATS:
        prec, _, out = exports(fmt)
        for file in out.glob("*.safetensors"):
            with safe_open(str(file), "pt") as f:
                dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
        tensors = load_safetensors(out)
        packed = [k for k in tensors if k.endswith(".weight_packed" if fmt == "compressed-tensors"
                                                    else ".weight") and tensors[k].dtype == torch.uint8]
        assert len(packed) == 7  # layers 1-3: up/down, q/k/v/o, in_proj (out_proj is BF16)
        for key in packed:
            module = "model." + key[len("backbone."):].rsplit(".", 1)[0]
            bits = hf_nvfp4.bits_per_weight({("model." + k[len("backbone."):]
                                              if k.startswith("backbone.") else k): v
                                             for k, v in tensors.items()}, module, fmt)
            # 4.5 + 32 / weights: the FP32 global scale (0.016 bits on k_proj's 32x64 here)
            assert 4.5 < bits <= 4.5 + 32 / (tensors[key].numel() * 2), (key, bits)
            assert dtypes[key] == "U8" and dtypes[key.rsplit(".", 1)[0] + ".weight_scale"] == "F8_E4M3"


def test_modelopt_export_dequantizes_by_modelopts_formula(exports, trained):
    """ModelOpt 0.47.0's NVFP4QTensor.dequantize (torch/quantization/qtensor/nvfp4_tensor.py
    :345-408, the non-fast path), written out here: nibble index -> e2m1 value (low nibble the
    even column, :356-357), per_block_scale = fp32(weight_scale) * weight_scale_2 (:400),
    value * per_block_scale (:407). weight_scale_2 is the forward's S_dec (decode direction)."""
    weights, amax_state = trained
    prec, bf16_dir, out = exports("modelopt")
    tensors = load_safetensors(out)
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6])
    amax, _ = running_input_amax(amax_state)
    for module, (values, s_dec) in forward_operands(weights, prec).items():
        name = saved_key(module)
        packed, scale = tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"]
        scale_2 = tensors[f"{name}.weight_scale_2"]
        assert packed.dtype == torch.uint8 and scale.dtype == torch.float8_e4m3fn
        assert scale_2.shape == () and torch.equal(scale_2, s_dec)
        unpacked = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
        unpacked[..., 1::2] = packed >> 4
        unpacked[..., 0::2] = packed & 0x0F
        q = e2m1[unpacked.long()]
        per_block_scale = scale.to(torch.float32) * scale_2
        deq = (q.view(*q.shape[:-1], -1, 16) * per_block_scale.unsqueeze(-1)).reshape(q.shape)
        # The codes times the E4M3 scales are the forward's q * s exactly ...
        assert torch.equal((q.view(*q.shape[:-1], -1, 16) * scale.float().unsqueeze(-1))
                           .reshape(q.shape), values), module
        # ... and ModelOpt's order of products (s * S_dec first) differs from (q * s) * S_dec
        # by at most one FP32 rounding: <= 2 ulp relative.
        ours = values * s_dec
        assert torch.allclose(deq, ours, rtol=2 ** -22, atol=0), module
        assert torch.equal(tensors[f"{name}.input_scale"], tensor_scales(
            torch.tensor(amax[policy_key(module)]))[1])
    quant = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "NVFP4" and quant["group_size"] == 16
    assert quant["exclude_modules"] == sorted([
        "lm_head", "model.layers.0.mixer.in_proj", "model.layers.0.mixer.out_proj",
        "model.layers.3.mixer.out_proj", "model.layers.4.mixer.down_proj",
        "model.layers.4.mixer.up_proj"])
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "modelopt" and config["ignore"] == quant["exclude_modules"]


@torch._dynamo.config.patch(disable=True)
def test_transformers_loads_the_export_and_matches_the_nvfp4_weight_forward(
        exports, trained, monkeypatch):
    """transformers (with compressed-tensors) loads the export on CPU, decompressed; its logits
    equal the project's forward with the NVFP4 weights (dequantized in FP32) and BF16-free FP32
    activations, within the BF16 rounding the decompression applies to each weight."""
    pytest.importorskip("compressed_tensors", reason="the Hugging Face extra: pip install -e '.[hf]'")
    from transformers import AutoModelForCausalLM, AutoTokenizer, CompressedTensorsConfig

    monkeypatch.setattr("nvfp4_recipe.megatron.parallel_linear.COMPUTE_DTYPE", torch.float32)
    weights, _ = trained
    prec, _, out = exports("compressed-tensors")
    # dequantize=True: transformers runs compressed-tensors' decompress on each packed linear
    # while loading (integrations/compressed_tensors.py CompressedTensorsDequantize).
    theirs = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    ).eval()
    assert all(p.dtype == torch.float32 for p in theirs.parameters())
    # The project's forward with the weights the NVFP4 Fprop used: (q * s) * S_dec in FP32.
    dequantized = dict(weights)
    for key, fmt in nvfp4_linears(prec).items():
        if fmt == "nvfp4":
            _, index, name = key.split(".", 2)
            w = hf_nvfp4.megatron_weight(weights, TINY, int(index), name)
            w_hat = quantize_nvfp4(w.to(torch.bfloat16), (16, 16), kernels="eager").dequantize()
            if name == "mixer.in_proj":
                start = 0
                for part, size in hf._in_proj_parts(TINY):
                    dequantized[f"decoder.layers.{index}.{name}.weight.{part}"] = \
                        w_hat[start:start + size]
                    start += size
            else:
                dequantized[f"decoder.layers.{index}.{name}.weight"] = w_hat
    ids = torch.randint(0, VOCAB, (2, 40))

    def project_logits(cast):
        ours = build_model(TINY, PrecisionConfig(), vocab_size=VOCAB, backend="emulated",
                           params_dtype=torch.float32).module.eval()
        hf.load_full_tensors(ours, lambda key, shape: cast(dequantized[key]).float())
        with torch.no_grad():
            return ours(ids, None, None)[..., :VOCAB]

    with torch.no_grad():
        hf_logits = theirs(ids).logits
    exact = project_logits(lambda t: t)  # the NVFP4 weights in FP32, as the FP4 GEMM has them

    def rel(ours):
        return ((ours - hf_logits).abs().max() / ours.abs().max()).item()

    # compressed-tensors decompresses to BF16 (unpack_fp4_from_uint8's default dtype, then
    # dequantize(dtype=bf16): compressors/nvfp4/base.py:119-130), so each weight moves by up to
    # 2^-9 relative: measured 2.0e-3 of the largest logit. With the same BF16 rounding on the
    # project's side the weights are identical (no 1-ulp flip here, see above) and what remains
    # is the two implementations' FP32 arithmetic: measured 2.7e-5.
    assert rel(exact) < 5e-3, rel(exact)
    assert rel(project_logits(lambda t: t.to(torch.bfloat16))) < 1e-4
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("alpha beta", return_tensors="pt")
    generated = theirs.generate(**ids, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] == ids["input_ids"].shape[1] + 4


def test_weights_only_export_has_no_input_scales(exports):
    _, _, out = exports("compressed-tensors", weights_only=True)
    tensors = load_safetensors(out)
    assert not [k for k in tensors if k.endswith("input_global_scale")]
    group = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]
    assert group["group_0"]["input_activations"] is None


def test_one_mamba_group_warns_that_vllm_serves_the_nvfp4_in_proj_at_tp1_only():
    """vLLM 0.33.0 cannot load an NVFP4 in_proj of a one-group Mamba at TP > 1
    (mamba_mixer2.py:456-467): the export says so, and only when it applies."""
    one_group = dataclasses.replace(TINY, mamba_num_groups=1)
    formats = precision_policy(one_group, precision()).linear_formats()
    assert formats["layers.3.mixer.in_proj"] == "nvfp4"
    [limit] = hf_nvfp4.vllm_limits(one_group, formats)
    assert "mamba_num_groups=1" in limit and "tensor parallel size 1" in limit
    assert hf_nvfp4.vllm_limits(TINY, nvfp4_linears(precision())) == []  # 2: no in_proj limit
    in_proj_bf16 = precision_policy(one_group, dataclasses.replace(
        precision(), overrides={OVERRIDE: "bf16", "*.mixer.in_proj": "bf16"})).linear_formats()
    assert hf_nvfp4.vllm_limits(one_group, in_proj_bf16) == []


def test_the_export_warns_each_vllm_limit_of_the_run(tmp_path, monkeypatch, tiny_tokenizer,
                                                    trained, caplog):
    """The command prints what vllm_limits finds for the run it exports (stated here: the tiny
    model has two groups, no limit of its own)."""
    weights, amax = trained
    run = write_run(tmp_path, tiny_tokenizer, weights, amax, precision(), monkeypatch)
    seen = []
    monkeypatch.setattr(hf_nvfp4, "vllm_limits", lambda cfg, formats: seen.append(
        (cfg.mamba_num_groups, formats["layers.3.mixer.in_proj"])) or ["a stated limit"])
    with caplog.at_level("WARNING", logger="nvfp4_pretrain"):
        assert hf_export.main([str(run), "--output", str(tmp_path / "out"), "--weights",
                               "nvfp4"]) == 0
    assert seen == [(2, "nvfp4")]
    assert "warning: a stated limit" in caplog.text


def test_refusals_are_one_line_before_anything_is_written(tmp_path, monkeypatch, capsys,
                                                          tiny_tokenizer, trained):
    weights, amax = trained
    out = tmp_path / "out"

    def run_with(prec, state=amax, name="r"):
        return write_run(tmp_path / name, tiny_tokenizer, weights, state, prec, monkeypatch)

    def refused(run, *args, code=2, text=""):
        assert hf_export.main([str(run), "--output", str(out), *args]) == code
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and text in err[0], err
        assert not out.exists()

    bf16_run = run_with(PrecisionConfig(), name="bf16")
    refused(bf16_run, "--weights", "nvfp4", text="never trained a linear in NVFP4")
    refused(bf16_run, "--format", "modelopt", text="apply to --weights nvfp4 only")
    refused(bf16_run, "--weights", "fp4", text="--weights fp4")
    run = run_with(precision(), name="ok")
    refused(run, "--weights", "nvfp4", "--format", "gguf", text="--format gguf")
    refused(run, "--weights", "nvfp4", "--format", "modelopt", "--weights-only",
            text="compressed-tensors")
    refused(run, "--weights", "nvfp4", "--zero-amax", "skip", text="--zero-amax skip")
    refused(run, "--weights", "nvfp4", "--format", "modelopt", "--zero-amax", "weights-only",
            text="use --format compressed-tensors")
    refused(run, "--weights", "nvfp4", "--weights-only", "--zero-amax", "refuse",
            text="not --weights-only")
    refused(bf16_run, "--zero-amax", "weights-only", text="applies to --weights nvfp4")
    mx = PrecisionConfig(name="x", format="nvfp4", bf16_first_layers=1, bf16_last_layers=1,
                         overrides={"layers.2.self_attention.linear_qkv": "fp8"})
    refused(run_with(mx, name="mixed"), "--weights", "nvfp4", text="in fp8")
    old = run_with(precision(), state=None, name="old")  # a checkpoint without the amax
    refused(old, "--weights", "nvfp4", text="no recorded input amax")
    assert hf_export.main([str(old), "--output", str(out), "--weights", "nvfp4",
                           "--weights-only"]) == 0
    out.rename(tmp_path / "done")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("mine")
    assert hf_export.main([str(run), "--output", str(tmp_path / "full"), "--weights",
                           "nvfp4"]) == 2
    assert "not empty" in capsys.readouterr().err
    with pytest.raises(hf.HFError, match="cannot be packed"):
        hf_nvfp4.check_packable("layers.1.mlp.linear_fc1", torch.zeros(24, 64), 16)
    with pytest.raises(hf.HFError, match="cannot be packed"):
        hf_nvfp4.check_packable("layers.1.mlp.linear_fc1", torch.zeros(32, 40), 1)


# -- a linear without a usable input amax: refused by name, or exported weights-only ------------

QKV = "layers.2.self_attention.linear_qkv"  # fused in vLLM: the case a "Linear" target gets wrong
FC2 = "layers.1.mlp.linear_fc2"
QKV_MODULES = [f"model.layers.2.mixer.{p}_proj" for p in "qkv"]


def with_amax(state: dict, **columns) -> dict:
    """The recorder state with every row of the named linears' columns set (name with . -> __)."""
    state = {**state, "history": state["history"].clone()}
    for name, value in columns.items():
        state["history"][:, state["names"].index(name.replace("__", "."))] = value
    return state


def files_under(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
            for p in sorted(root.rglob("*"))}


def test_unusable_input_amax_is_zero_tiny_or_non_finite():
    """The values whose tensor_scales give no usable static scale: 0 -> S_enc = FLT_MAX (what
    vLLM would multiply the inputs by), below 448*6/FLT_MAX -> the same clamp, inf -> S_enc 1
    (tensor_scales' 0 -> 1), NaN -> NaN. A small but representable amax stays usable."""
    fmax = torch.finfo(torch.float32).max
    assert float(tensor_scales(torch.tensor(0.0))[0]) == fmax
    formats = {f"layers.1.{n}": "nvfp4" for n in ("a", "b", "c", "d", "e", "f", "h")}
    formats["layers.1.g"] = "bf16"
    amax = {"layers.1.a": 0.0, "layers.1.b": float("nan"), "layers.1.c": float("inf"),
            "layers.1.d": 1e-38, "layers.1.e": 1e-30, "layers.1.f": 3.5, "layers.1.g": 0.0,
            "layers.1.h": -1.0}
    bad = hf_nvfp4.unusable_input_amax(amax, formats)
    assert set(bad) == {"layers.1.a", "layers.1.b", "layers.1.c", "layers.1.d", "layers.1.h"}
    assert float(tensor_scales(torch.tensor(1e-30))[0]) < fmax  # e: a real (if odd) scale
    assert "would be FLT_MAX" in hf_nvfp4.amax_problem("layers.1.a", 0.0, 7)
    assert "over the 7-step window" in hf_nvfp4.amax_problem("layers.1.a", 0.0, 7)
    assert "nan (non-finite" in hf_nvfp4.amax_problem("layers.1.b", float("nan"), 7)
    assert "clamped to FLT_MAX" in hf_nvfp4.amax_problem("layers.1.d", 1e-38, 7)
    assert "-1.0 (negative" in hf_nvfp4.amax_problem("layers.1.h", -1.0, 7)
    # input_scales never turns an unusable amax into a scale, unless told to skip that linear.
    with pytest.raises(hf.HFError, match="layers.1.a: recorded input amax is 0"):
        hf_nvfp4.input_scales(amax, formats)


@pytest.mark.parametrize("fmt", hf_nvfp4.FORMATS)
def test_a_linear_with_zero_or_non_finite_amax_is_refused_naming_it_before_writing(
        tmp_path, monkeypatch, capsys, tiny_tokenizer, trained, fmt):
    """By default the export refuses (exit 2) with one line naming every such linear, the
    window and what the scale would be; nothing is created (no --output, no temporary)."""
    weights, amax = trained
    state = with_amax(amax, **{QKV.replace(".", "__"): 0.0, FC2.replace(".", "__"): float("nan")})
    run = write_run(tmp_path / "r", tiny_tokenizer, weights, state, precision(), monkeypatch)
    before = files_under(tmp_path)
    out = tmp_path / "out"
    assert hf_export.main([str(run), "--output", str(out), "--weights", "nvfp4",
                           "--format", fmt]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    line = err[0]
    assert (f"{QKV}: recorded input amax is 0 over the 2-step window (all-zero or non-finite "
            "inputs); its static input scale would be FLT_MAX") in line
    assert f"{FC2}: recorded input amax is nan" in line
    assert "--zero-amax weights-only" in line
    assert not out.exists() and files_under(tmp_path) == before
    # An explicit --zero-amax refuse is the default.
    assert hf_export.main([str(run), "--output", str(out), "--weights", "nvfp4", "--format",
                           fmt, "--zero-amax", "refuse"]) == 2
    assert QKV in capsys.readouterr().err and files_under(tmp_path) == before


@torch._dynamo.config.patch(disable=True)
def test_zero_amax_weights_only_exports_that_linear_w4a16_and_the_rest_unchanged(
        tmp_path, monkeypatch, capsys, caplog, tiny_tokenizer, trained):
    """--zero-amax weights-only: the zero-amax linear (attention qkv: three transformers modules,
    one vLLM qkv_proj) has no input_global_scale, every other tensor equals the normal export's,
    config.json gives it a second config group without input_activations, nvfp4_export.json
    names it, the command prints it; compressed-tensors assigns the schemes per module as
    written, and transformers loads it to the same weights as the normal export."""
    pytest.importorskip("compressed_tensors", reason="the Hugging Face extra: pip install -e '.[hf]'")
    weights, amax = trained
    normal = write_run(tmp_path / "n", tiny_tokenizer, weights, amax, precision(), monkeypatch)
    ref = tmp_path / "ref"
    assert hf_export.main([str(normal), "--output", str(ref), "--weights", "nvfp4"]) == 0
    run = write_run(tmp_path / "z", tiny_tokenizer, weights,
                    with_amax(amax, **{QKV.replace(".", "__"): 0.0}), precision(), monkeypatch)
    out = tmp_path / "out"
    with caplog.at_level("WARNING", logger="nvfp4_pretrain"):
        assert hf_export.main([str(run), "--output", str(out), "--weights", "nvfp4",
                               "--zero-amax", "weights-only"]) == 0
    [said] = [r.getMessage() for r in caplog.records if "weights-only" in r.getMessage()]
    assert said.startswith(f"warning: {QKV}: recorded input amax is 0 over the 2-step window")
    assert said.endswith("exported weights-only (W4A16, no input scale): " + ", ".join(QKV_MODULES))

    tensors, reference = load_safetensors(out), load_safetensors(ref)
    dropped = {f"{saved_key(m)}.input_global_scale" for m in QKV_MODULES}
    assert dropped <= set(reference) and not dropped & set(tensors)
    assert set(tensors) == set(reference) - dropped
    for name, tensor in tensors.items():  # codes, scales, other input scales: unchanged
        assert torch.equal(tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn
                           else tensor, reference[name].view(torch.uint8)
                           if tensor.dtype == torch.float8_e4m3fn else reference[name]), name

    config = json.loads((out / "config.json").read_text())["quantization_config"]
    ref_config = json.loads((ref / "config.json").read_text())["quantization_config"]
    groups = config["config_groups"]
    w4a4 = sorted({saved_key(k).replace("backbone.", "model.", 1).rsplit(".", 1)[0]
                   for k in reference if k.endswith(".input_global_scale")} - set(QKV_MODULES))
    assert groups["group_0"]["targets"] == w4a4 and len(w4a4) == 4  # fc1, fc2, o_proj, in_proj
    assert groups["group_0"]["input_activations"] == \
        ref_config["config_groups"]["group_0"]["input_activations"]
    assert groups["group_1"]["targets"] == sorted(QKV_MODULES)
    assert groups["group_1"]["input_activations"] is None
    assert groups["group_1"]["weights"] == groups["group_0"]["weights"]
    assert config["ignore"] == ref_config["ignore"]
    about = json.loads((out / hf.EXPORT_MARKER).read_text())
    assert about["weights_only_modules"] == sorted(QKV_MODULES) and about["activations"] == "nvfp4"
    assert json.loads((ref / hf.EXPORT_MARKER).read_text())["weights_only_modules"] == []

    # compressed-tensors' own target matching (apply_quantization_config) on the transformers
    # model: q/k/v get the weight-only scheme, the other NVFP4 linears W4A4, the BF16 ones none.
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from transformers import AutoConfig, AutoModelForCausalLM, CompressedTensorsConfig

    hf_config = AutoConfig.from_pretrained(out)
    hf_config.quantization_config = None
    model = AutoModelForCausalLM.from_config(hf_config)
    apply_quantization_config(model, QuantizationConfig.model_validate(config),
                              show_progress=False)
    schemes = {n: getattr(m, "quantization_scheme", None) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear)}
    for name, scheme in schemes.items():
        if name in QKV_MODULES:
            assert scheme.weights is not None and scheme.input_activations is None, name
        elif name in w4a4:
            assert scheme.input_activations is not None, name
        else:
            assert scheme is None and name in config["ignore"], name

    # vLLM's lookup (compressed_tensors/utils.py find_matched_target, rewritten): name, then the
    # class name as a substring, then the fused parts. Its qkv_proj (QKVParallelLinear) takes
    # group_1 through q_proj; with a "Linear" target it would have taken the W4A4 group.
    def vllm_target(layer, cls, targets):
        fused = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
        hit = next((t for t in targets if t == layer), None) or \
            next((t for t in targets if t.lower() in cls.lower()), None)
        if hit is None and layer.rsplit(".", 1)[1] in fused:
            parts = [layer.rsplit(".", 1)[0] + "." + p for p in fused[layer.rsplit(".", 1)[1]]]
            if all(p in targets for p in parts):
                hit = parts[0]
        return hit

    every = groups["group_0"]["targets"] + groups["group_1"]["targets"]
    assert vllm_target("model.layers.2.mixer.qkv_proj", "QKVParallelLinear", every) in \
        groups["group_1"]["targets"]
    assert vllm_target("model.layers.2.mixer.o_proj", "RowParallelLinear", every) in \
        groups["group_0"]["targets"]
    assert vllm_target("model.layers.2.mixer.qkv_proj", "QKVParallelLinear",
                       ["Linear"] + QKV_MODULES) == "Linear"

    # transformers with compressed-tensors loads it (decompressed) to the normal export's weights.
    def loaded(directory):
        return AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.float32,
            quantization_config=CompressedTensorsConfig(dequantize=True)).state_dict()

    ours, theirs = loaded(out), loaded(ref)
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


def test_every_nvfp4_linear_weights_only_leaves_one_w4a16_group(tmp_path, monkeypatch,
                                                                 tiny_tokenizer, trained):
    """All NVFP4 linears without a usable amax: no input scale anywhere, one config group (the
    NVFP4A16 one) naming them, no empty W4A4 group."""
    weights, amax = trained
    state = {**amax, "history": torch.zeros_like(amax["history"])}
    run = write_run(tmp_path / "z", tiny_tokenizer, weights, state, precision(), monkeypatch)
    out = tmp_path / "out"
    assert hf_export.main([str(run), "--output", str(out), "--weights", "nvfp4",
                           "--zero-amax", "weights-only"]) == 0
    assert not [k for k in load_safetensors(out) if k.endswith("input_global_scale")]
    groups = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]
    assert list(groups) == ["group_1"] and groups["group_1"]["input_activations"] is None
    assert len(groups["group_1"]["targets"]) == 7  # up/down, q/k/v, o, in_proj


def test_serving_export_refuses_a_weights_only_linear_in_modelopt(exports, trained):
    """The library call, not only the command, never writes a ModelOpt linear without its
    input_scale."""
    weights, amax_state = trained
    prec = precision()
    formats = nvfp4_linears(prec)
    amax, _ = running_input_amax(amax_state)
    packed = hf_nvfp4.packed_linears(weights, TINY, formats, True)
    inputs = hf_nvfp4.input_scales(amax, formats, frozenset({QKV}))
    with pytest.raises(hf.HFError, match="model.layers.2.mixer.k_proj: a weights-only linear"):
        hf_nvfp4.serving_export("modelopt", hf.to_hf(weights, TINY, VOCAB), packed, inputs,
                                hf_nvfp4.bf16_linear_names(TINY, formats))

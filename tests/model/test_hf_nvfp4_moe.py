"""NVFP4 serving exports of hybrid MoE models (model/hf_nvfp4.py, `tools.hf_export --weights
nvfp4`): every routed expert stored as its own compressed-tensors NVFP4 module under the names
vLLM's nemotron_h loads, the quantization_config resolving each MoE layer to one scheme as vLLM
resolves it, a routed expert no token reached given its layer's input scale, and what vLLM could
not serve refused before writing.

vLLM is not installed here. `vllm_moe_scheme` is a twin of how vLLM 0.33.0-0.34.0 picks an MoE
layer's scheme, written from its source (model_executor/layers/quantization/compressed_tensors/
compressed_tensors_moe/compressed_tensors_moe.py:33-58: the scheme of `<layer>.0.up_proj`,
`<layer>.0.None` and `<layer>.0.down_proj` for nemotron_h's gate-less experts, which must agree;
compressed_tensors.py:221-232 and :998-1031, utils.py:53-111: `ignore` first, exact or `re:`,
then each group's targets, exact or `re:`, then by class name, where a "Linear" target also
names the fused experts' class RoutedExperts)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

pytest.importorskip("transformers", reason="the Hugging Face extra: pip install -e '.[hf]'")

from hf_helpers import (TINY_MOE, load_safetensors, trained_weights_and_amax,  # noqa: E402
                        write_export_run)
from model import hf_nvfp4  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from nvfp4_recipe.megatron.input_amax import running_input_amax  # noqa: E402
from nvfp4_recipe.nvfp4 import quantize_nvfp4, tensor_scales  # noqa: E402
from nvfp4_recipe.policy import PrecisionConfig  # noqa: E402
from tools import hf_export  # noqa: E402

MOE = TINY_MOE
# Layers 1 and 3 MoE in NVFP4; layer 4 MoE in BF16 (the last layer).
TINY = ModelConfig(pattern="ME*EE", hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                   num_query_groups=2, kv_channels=16, mamba_num_heads=16, mamba_head_dim=8,
                   mamba_state_dim=16, mamba_num_groups=2, mamba_chunk_size=16, vocab_size=300,
                   spec="portable", moe=MOE)
VOCAB = 300
NVFP4_MOE, BF16_MOE = (1, 3), (4,)


def precision(**kw) -> PrecisionConfig:
    return PrecisionConfig(name="nvfp4", format="nvfp4", bf16_first_layers=1, bf16_last_layers=1,
                           gemm="exact", kernels="eager", **kw)


@pytest.fixture(scope="module")
def trained(parallel_context):
    from transformers import NemotronHForCausalLM  # noqa: F401  (its import-time warnings)

    return trained_weights_and_amax(TINY, precision(), VOCAB)


def vllm_moe_scheme(config: dict, layer: int):
    """The scheme vLLM gives MoE layer `layer`'s fused experts (None: unquantized); ValueError
    where its three names resolve differently, as vLLM raises."""
    def matches(pattern: str, name: str) -> bool:
        return (re.match(pattern[3:], name) is not None if pattern.startswith("re:")
                else pattern == name)

    def scheme(name: str):
        if any(matches(p, name) for p in config["ignore"]):
            return None
        for group_name, group in config["config_groups"].items():
            for target in group["targets"]:
                if matches(target, name) or target in ("Linear", "RoutedExperts"):
                    return group_name
        return None

    prefix = f"model.layers.{layer}.mixer.experts.0."
    found = {scheme(prefix + p) for p in ("up_proj", "None", "down_proj")}
    if len(found) != 1:
        raise ValueError("All MoE projections need to have same quantization scheme")
    return found.pop()


def export(tmp_path, tiny_tokenizer, trained, monkeypatch, *args, prec=None, amax=None):
    weights, amax_state = trained
    run = write_export_run(tmp_path, TINY, tiny_tokenizer, weights, amax or amax_state,
                           prec or precision(), monkeypatch)
    out = tmp_path / "served"
    code = hf_export.main([str(run), "--output", str(out), "--weights", "nvfp4", *args])
    return code, out


def test_routed_experts_are_written_one_nvfp4_module_each_as_vllm_loads_them(
        tmp_path, tiny_tokenizer, trained, monkeypatch):
    import json

    weights, amax_state = trained
    code, out = export(tmp_path, tiny_tokenizer, trained, monkeypatch)
    assert code == 0
    tensors = load_safetensors(out)
    amax, _ = running_input_amax(amax_state)
    for layer in NVFP4_MOE:
        for e in range(4):
            for fc, proj in (("1", "up_proj"), ("2", "down_proj")):
                name = f"backbone.layers.{layer}.mixer.experts.{e}.{proj}"
                # the expert's own slice of megatron's [experts, out, in] tensor, quantized as
                # the emulated Fprop quantized it (16x16 tiles, nearest)
                w = weights[f"decoder.layers.{layer}.mlp.experts.experts.linear_fc{fc}.weight"][e]
                q = quantize_nvfp4(w.to(torch.bfloat16), (16, 16), kernels="eager")
                assert torch.equal(tensors[f"{name}.weight_packed"], q.data), name
                assert torch.equal(tensors[f"{name}.weight_scale"].view(torch.uint8),
                                   q.scales.view(torch.uint8)), name
                assert torch.equal(tensors[f"{name}.weight_global_scale"],
                                   tensor_scales(q.amax)[0].reshape(1)), name
                key = f"layers.{layer}.mlp.experts.local_experts.{e}.linear_fc{fc}"
                want = tensor_scales(torch.tensor(amax[key], dtype=torch.float32))[0]
                assert torch.equal(tensors[f"{name}.input_global_scale"], want.reshape(1)), name
                assert f"{name}.weight" not in tensors
        # the router and its bias stay unquantized (vLLM builds the gate without quant_config)
        assert f"backbone.layers.{layer}.mixer.gate.weight" in tensors
        assert f"backbone.layers.{layer}.mixer.shared_experts.up_proj.weight_packed" in tensors
    for layer in BF16_MOE:  # the BF16 last layer: plain per-expert weights
        assert tensors[f"backbone.layers.{layer}.mixer.experts.3.down_proj.weight"].dtype == \
            torch.bfloat16
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert [vllm_moe_scheme(config, i) for i in NVFP4_MOE] == ["group_0", "group_0"]
    assert [vllm_moe_scheme(config, i) for i in BF16_MOE] == [None]


def test_a_split_export_targets_each_moe_layer_with_one_pattern(tmp_path, tiny_tokenizer,
                                                                trained, monkeypatch):
    """A dense linear written weights-only splits the config into named groups; the experts
    then go in by a pattern vLLM matches for all three of a layer's names (by name, `.0.None`
    would be left unmatched and vLLM would refuse the layer)."""
    import json

    weights, state = trained
    state = {**state, "history": state["history"].clone()}
    state["history"][:, state["names"].index("layers.2.self_attention.linear_proj")] = 0.0
    code, out = export(tmp_path, tiny_tokenizer, trained, monkeypatch, "--zero-amax",
                       "weights-only", amax=state)
    assert code == 0
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert set(config["config_groups"]) == {"group_0", "group_1"}
    assert config["config_groups"]["group_1"]["targets"] == ["model.layers.2.mixer.o_proj"]
    assert hf_nvfp4.experts_pattern(1) in config["config_groups"]["group_0"]["targets"]
    assert [vllm_moe_scheme(config, i) for i in (*NVFP4_MOE, *BF16_MOE)] == [
        "group_0", "group_0", None]
    # listing the experts by name instead is what vLLM refuses
    named = {**config, "config_groups": {"group_0": {"targets": [
        f"model.layers.1.mixer.experts.{e}.{p}" for e in range(4) for p in ("up_proj",
                                                                             "down_proj")]}}}
    with pytest.raises(ValueError, match="same quantization scheme"):
        vllm_moe_scheme(named, 1)


def test_an_expert_no_token_reached_takes_its_layers_input_scale():
    formats = {f"layers.1.mlp.experts.local_experts.{e}.linear_fc{f}": "nvfp4"
               for e in range(3) for f in (1, 2)}
    amax = {f"layers.1.mlp.experts.local_experts.{e}.linear_fc1": a
            for e, a in enumerate((2.0, 0.0, 5.0))}
    amax.update({f"layers.1.mlp.experts.local_experts.{e}.linear_fc2": a
                 for e, a in enumerate((0.0, 0.0, 0.0))})
    filled = hf_nvfp4.fill_expert_input_amax(amax, formats)
    assert filled["layers.1.mlp.experts.local_experts.1.linear_fc1"] == 5.0  # the layer's max
    assert filled["layers.1.mlp.experts.local_experts.0.linear_fc1"] == 2.0  # its own
    # no expert of the projection saw input: left to the export's refusal / weights-only
    assert filled["layers.1.mlp.experts.local_experts.0.linear_fc2"] == 0.0


@pytest.mark.parametrize("args, overrides, message", [
    ([], {"layers.1.mlp.experts.local_experts.2.*": "bf16"},
     "layer 1's routed experts ran their forward in bf16 and nvfp4; vLLM serves one scheme per "
     "MoE layer"),
    (["--format", "modelopt"], {},
     "--format modelopt: layer 1's routed experts are written in compressed-tensors only"),
])
def test_what_vllm_cannot_serve_is_refused_before_writing(tmp_path, tiny_tokenizer, trained,
                                                          monkeypatch, capsys, args, overrides,
                                                          message):
    code, out = export(tmp_path, tiny_tokenizer, trained, monkeypatch, *args,
                       prec=precision(overrides=overrides))
    assert code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()

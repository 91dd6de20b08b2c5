"""Hugging Face round trips (model/hf.py, tools/hf_export.py), on CPU with small random models made here.

The conversions in one process (project -> transformers logits, transformers -> project ->
transformers weights, config checks, the 12B config.json). train.py and the export CLI as a user
runs them (demo export + generate(); model.init_from at TP=1 and TP=2, both exported):
tests/system/test_hf_runs.py.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the Hugging Face extra: pip install -e '.[hf]'")

from helpers import model_config, model_full_tensors  # noqa: E402
from hf_helpers import hf_model, random_hf_dir, rewrite_tensors, truncate  # noqa: E402

from errors import ExitCode  # noqa: E402
from model import hf  # noqa: E402
from model.build import build_model  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from nvfp4_recipe.policy import PrecisionConfig  # noqa: E402
from tools import hf_export  # noqa: E402

# All three layer kinds, GQA (4 query heads on 2 KV groups), 2 Mamba groups; vocabulary 300,
# padded to 384 by the project (the export strips it back to 300).
TINY = ModelConfig(pattern="M-*M-", hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                   num_query_groups=2, kv_channels=16, mamba_num_heads=8, mamba_head_dim=16,
                   mamba_state_dim=16, mamba_num_groups=2, mamba_chunk_size=16, vocab_size=300,
                   spec="portable")
VOCAB = 300
# max |project - transformers| / max |logit| with FP32 GEMMs on both sides; measured 3e-7
# (transformers 5.24.0, torch 2.13 CPU): what remains is summation order.
LOGITS_RTOL = 1e-5


def _project_model(cfg: ModelConfig, dtype=torch.float32):
    return build_model(cfg, PrecisionConfig(), vocab_size=cfg.vocab_size, backend="emulated",
                       params_dtype=dtype).module.eval()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


# megatron compiles squared_relu on first use (jit_fuser): 5 s of the test, same numbers. Patched
# with dynamo's own context: monkeypatch's undo deletes the key, which hides it from dynamo for the
# rest of the session ("torch._dynamo.config.disable does not exist" in every later compile).
@torch._dynamo.config.patch(disable=True)
def test_project_logits_match_transformers_with_fp32_gemms(parallel_context, monkeypatch):
    # The portable linears multiply BF16 operands (as training does); compare FP32 GEMMs.
    monkeypatch.setattr("nvfp4_recipe.megatron.parallel_linear.COMPUTE_DTYPE", torch.float32)
    torch.manual_seed(0)
    ours = _project_model(TINY)
    with torch.no_grad():  # one head per Mamba layer with step sizes far below 0.001
        for i, kind in enumerate(TINY.layer_kinds()):
            if kind == "mamba":
                ours.decoder.layers[i].mixer.dt_bias[0] = -9.0
    state = hf.to_hf(model_full_tensors(ours), TINY, VOCAB)
    assert state["lm_head.weight"].shape == (VOCAB, TINY.hidden_size)  # padding stripped
    theirs = hf_model(TINY, VOCAB)
    theirs.load_state_dict(state, strict=True)
    ids = torch.randint(0, VOCAB, (2, 40))  # 40 tokens: 3 Mamba chunks of 16
    with torch.no_grad():
        ours_logits = ours(ids, None, None)[..., :VOCAB]
        hf_logits = theirs(ids).logits
    assert _rel(ours_logits, hf_logits) < LOGITS_RTOL

    # What the exported time_step_min removes: up to transformers 5.24 the mixer clamps step
    # sizes at config.time_step_min (default 0.001: it changes these logits); from 5.25 at
    # config.time_step_limit (default (0, inf): time_step_min is then only an init bound).
    clamped = hf_model(TINY, VOCAB, time_step_min=0.001)
    clamped.load_state_dict(state, strict=True)
    mixer = next(layer.mixer for layer in clamped.model.layers if hasattr(layer.mixer, "dt_bias"))
    with torch.no_grad():
        change = _rel(ours_logits, clamped(ids).logits)
    if mixer.time_step_limit[0] == 0.001:  # the clamp follows time_step_min
        assert change > 10 * LOGITS_RTOL
    else:
        assert mixer.time_step_limit[0] == 0.0 and change < LOGITS_RTOL
    # transformers' clamp (modeling_nemotron_h.py:296) at the exported floor is the identity.
    dt = torch.tensor([0.0, 1e-45, 1e-38, 1e-3])
    floor = hf.hf_config(TINY, VOCAB, eos_token_id=0).time_step_min
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(torch.clamp(dt.to(dtype), min=floor), dt.to(dtype))


def test_transformers_to_project_to_transformers_is_bit_identical(parallel_context,
                                                                   tmp_path):
    from transformers import AutoModelForCausalLM

    # Sharded on purpose: the import reads model.safetensors.index.json.
    hf_dir, original = random_hf_dir(tmp_path, TINY, VOCAB, max_shard_size="100KB")
    assert (hf_dir / "model.safetensors.index.json").is_file()
    cfg = dataclasses.replace(TINY, init_from=str(hf_dir))
    hf.check_init_from(cfg)  # the start-up check: config.json matches
    ours = _project_model(cfg, torch.bfloat16)
    hf.load_hf_weights(ours, cfg, VOCAB)
    ours.to(torch.bfloat16)  # what megatron's Float16Module does next in the trainer (D is FP32)
    back = hf.to_hf(model_full_tensors(ours), cfg, VOCAB)
    assert back.keys() == original.keys()
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name

    # ... and through the export writer and transformers' own loader.
    config = hf.hf_config(cfg, VOCAB, eos_token_id=0, pad_token_id=0)
    hf.write_hf_dir(tmp_path / "hf_out", config, back, tokenizer=None)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_out").state_dict()
    assert all(torch.equal(reloaded[k], v) for k, v in original.items())


def test_a_mismatched_config_is_refused_naming_each_field(parallel_context, tmp_path):
    hf_dir, _ = random_hf_dir(tmp_path, TINY, VOCAB)
    wrong = dataclasses.replace(TINY, hidden_size=128, pattern="M-*M", init_from=str(hf_dir))
    with pytest.raises(ValueError) as info:
        hf.check_init_from(wrong)  # before anything is built or written
    message = str(info.value)
    assert "model.hidden_size=128 but hidden_size=64" in message
    assert "model.pattern='M-*M'" in message and "'M-*M-'" in message
    assert "\n" not in message
    # The vocabulary, once the tokenizer gives it: 4096 tokens against the checkpoint's 300.
    cfg = dataclasses.replace(TINY, vocab_size=None, init_from=str(hf_dir))
    ours = build_model(cfg, PrecisionConfig(), vocab_size=4096, backend="emulated").module
    with pytest.raises(ValueError, match="vocabulary is 4096 .* but vocab_size=300"):
        hf.load_hf_weights(ours, cfg, 4096)


class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_pickle_weights_are_refused_unopened(tmp_path):
    hf_dir = tmp_path / "pickled"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(
        hf.hf_config_fields(TINY, VOCAB, eos_token_id=0) | {"model_type": "nemotron_h"}))
    marker = tmp_path / "pwned"
    (hf_dir / "pytorch_model.bin").write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(ValueError, match="pytorch_model.bin.*never loaded"):
        hf.check_init_from(dataclasses.replace(TINY, init_from=str(hf_dir)))
    assert not marker.exists()
    with pytest.raises(hf.HFError, match="no such directory") as missing:
        hf.check_init_from(dataclasses.replace(TINY, init_from=str(tmp_path / "missing")))
    assert missing.value.code == ExitCode.MISSING  # exit 3, not 2
    (tmp_path / "a_file").write_text("")
    with pytest.raises(hf.HFError, match="not a directory") as not_dir:
        hf.check_init_from(dataclasses.replace(TINY, init_from=str(tmp_path / "a_file")))
    assert not_dir.value.code == ExitCode.CONFIG


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_a_truncated_safetensors_file_is_refused_at_validate_naming_it(tmp_path, layout):
    """safetensors raises its own SafetensorError on a cut file; it becomes one ValueError line
    (exit 2 in train.py) at the start-up check, before anything is built or written."""
    save = {"max_shard_size": "100KB"} if layout == "sharded" else {}
    hf_dir, _ = random_hf_dir(tmp_path, TINY, VOCAB, **save)
    victim = sorted(hf_dir.glob("*.safetensors"))[-1]
    truncate(victim)
    with pytest.raises(ValueError) as info:
        hf.check_init_from(dataclasses.replace(TINY, init_from=str(hf_dir)))
    message = str(info.value)
    assert isinstance(info.value, hf.HFError) and info.value.code == ExitCode.CONFIG
    assert f"model.init_from={hf_dir}: {victim.name} is truncated or corrupt" in message
    assert "\n" not in message


@pytest.mark.parametrize("fault, named", [
    ("missing", "no model.layers.2.mixer.k_proj.weight"),
    ("extra", "tensors no layer has: model.layers.9.mixer.up_proj.weight"),
    ("shape", "model.layers.1.mixer.up_proj.weight is [64, 64], not [128, 64]"),
])
def test_a_tensor_list_that_does_not_fit_is_refused_at_validate_from_the_headers(
        tmp_path, fault, named):
    """Missing, extra or misshapen tensors are found in the safetensors headers by the start-up
    check (train.py calls it before anything is written), not while loading, after run.dir."""
    hf_dir, _ = random_hf_dir(tmp_path, TINY, VOCAB)
    # transformers 5 stores the NemotronH body as backbone.*, and names it model.* once loaded
    changes = {
        "missing": lambda t: t.pop("backbone.layers.2.mixer.k_proj.weight"),
        "extra": lambda t: t.update({"backbone.layers.9.mixer.up_proj.weight": torch.zeros(2, 2)}),
        "shape": lambda t: t.update({"backbone.layers.1.mixer.up_proj.weight":
                                     t["backbone.layers.1.mixer.up_proj.weight"][:64].clone()}),
    }
    rewrite_tensors(hf_dir, changes[fault])
    with pytest.raises(hf.HFError) as info:
        hf.check_init_from(dataclasses.replace(TINY, init_from=str(hf_dir)))
    assert info.value.code == ExitCode.CONFIG and named in str(info.value), str(info.value)
    assert "\n" not in str(info.value)


def test_a_nan_in_an_imported_tensor_is_named_as_it_loads(parallel_context, tmp_path):
    hf_dir, _ = random_hf_dir(tmp_path, TINY, VOCAB)
    rewrite_tensors(hf_dir, lambda t: t["backbone.layers.3.mixer.out_proj.weight"].view(-1)[5:7]
             .copy_(torch.tensor([float("nan"), float("inf")])))
    cfg = dataclasses.replace(TINY, init_from=str(hf_dir))
    hf.check_init_from(cfg)  # the headers are fine
    with pytest.raises(hf.HFError, match=r"backbone.layers.3.mixer.out_proj.weight in "
                                         r"model.safetensors: 2 of its 8192 values are NaN or Inf"):
        hf.load_hf_weights(_project_model(cfg, torch.bfloat16), cfg, VOCAB)


# The published NVIDIA-Nemotron-Nano-12B-v2-Base config.json, architecture fields. Sources (no
# network to huggingface.co here): the model card (huggingface.co/nvidia/
# NVIDIA-Nemotron-Nano-12B-v2-Base README: 62 layers = 28 Mamba-2 + 28 MLP + 6 GQA attention with
# 8 groups, 12.31B parameters, squared-ReLU MLP); Megatron-Bridge's NemotronNanoModelProvider12Bv2
# and NemotronHModelProvider (src/megatron/bridge/models/nemotronh/nemotron_h_provider.py:
# pattern, hidden 5120, FFN 20480, 40 heads, kv_channels 128, 128 Mamba heads of 80, state 128,
# 8 Mamba groups, 8 query groups) with the HF names of its NemotronHBridge.CONFIG_MAPPING
# (nemotron_h_bridge.py: n_groups, ssm_state_size, hybrid_override_pattern, layer_norm_epsilon);
# a public note quoting the config.json (vocab_size 131072, chunk_size 128, head_dim 128);
# the NVIDIA-Nemotron-Nano-12B-v2-Base model card and arXiv 2509.25149 appendix A.1 (RMSNorm eps
# 1e-5, conv kernel 4, expand 2, untied embeddings, no biases). max_position_embeddings (131072 there) is left out: Nemotron-H has no position
# embeddings, and the field is the context the card's long-context phase reached, where the
# project's recipe trains at 8192.
PUBLISHED_12B = {
    "model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"],
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M-",
    "num_hidden_layers": 62, "vocab_size": 131072, "hidden_size": 5120,
    "intermediate_size": 20480, "mlp_hidden_act": "relu2", "num_attention_heads": 40,
    "num_key_value_heads": 8, "head_dim": 128, "mamba_num_heads": 128, "mamba_head_dim": 80,
    "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4, "expand": 2, "chunk_size": 128,
    "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False, "use_bias": False,
    "mlp_bias": False, "attention_bias": False, "use_conv_bias": True,
}


def test_12b_config_json_matches_the_published_card(parallel_context, tmp_path):
    from transformers import AutoConfig, NemotronHForCausalLM

    cfg = dataclasses.replace(model_config("nemotron_h_12b"), spec="portable")
    hf.write_config(tmp_path, hf.hf_config(cfg, 131072, eos_token_id=2, bos_token_id=1,
                                           pad_token_id=0))
    written = json.loads((tmp_path / "config.json").read_text())
    assert {k: written[k] for k in PUBLISHED_12B} == PUBLISHED_12B
    assert hf.config_mismatches(PUBLISHED_12B, cfg, 131072) == []  # init_from would accept it
    config = AutoConfig.from_pretrained(tmp_path)  # transformers reads it back as written
    assert config.hybrid_override_pattern == PUBLISHED_12B["hybrid_override_pattern"]
    with torch.device("meta"):  # shapes only
        theirs = NemotronHForCausalLM(config)
        ours = build_model(cfg, PrecisionConfig(), vocab_size=131072, initialize=False,
                           backend="emulated").module
    assert sum(p.numel() for p in theirs.parameters()) == 12_310_001_152  # the card's 12.31B
    state = hf.to_hf(model_full_tensors(ours), cfg, 131072)
    expected = theirs.state_dict()
    assert state.keys() == expected.keys()
    assert all(state[k].shape == expected[k].shape for k in expected)


def test_export_refuses_bad_input_before_writing(tmp_path, capsys):
    out = tmp_path / "out"
    assert hf_export.main([str(tmp_path / "nope"), "--output", str(out)]) == 2
    assert "RUN_DIR=" in capsys.readouterr().err and not out.exists()
    (tmp_path / "run").mkdir()
    assert hf_export.main([str(tmp_path / "run"), "--output", str(out)]) == 2
    assert "no config.yaml" in capsys.readouterr().err and not out.exists()
    # What is already there is never overwritten without --overwrite.
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(hf.HFError, match="exists and is not empty.*--overwrite"):
        hf_export._check_output(out, overwrite=False)
    assert (out / "keep.txt").read_text() == "precious"

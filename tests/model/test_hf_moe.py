"""Hugging Face round trips of hybrid MoE models (model/hf.py; transformers' NemotronH with `moe`
layers): the project's logits against transformers' on random weights, transformers -> project
-> transformers bit for bit through the stored per-expert tensors, and what has no Hugging Face
form refused naming it."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

pytest.importorskip("transformers", reason="the Hugging Face extra: pip install -e '.[hf]'")

from helpers import model_full_tensors  # noqa: E402
from hf_helpers import TINY_MOE, hf_model, load_safetensors, random_hf_dir  # noqa: E402

from model import hf  # noqa: E402
from model.build import build_model  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from nvfp4_recipe.policy import PrecisionConfig  # noqa: E402

# Nemotron 3's routing at test size (hf_helpers.TINY_MOE); every layer kind, MoE twice.
MOE = TINY_MOE
TINY = ModelConfig(pattern="ME*E-", hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                   num_query_groups=2, kv_channels=16, mamba_num_heads=8, mamba_head_dim=16,
                   mamba_state_dim=16, mamba_num_groups=2, mamba_chunk_size=16, vocab_size=300,
                   spec="portable", moe=MOE)
VOCAB = 300
# As the dense models' test (test_hf.py): FP32 GEMMs on both sides leave summation order.
LOGITS_RTOL = 1e-5


def _project_model(cfg: ModelConfig, dtype=torch.float32):
    return build_model(cfg, PrecisionConfig(), vocab_size=cfg.vocab_size, backend="emulated",
                       params_dtype=dtype).module.eval()


@torch._dynamo.config.patch(disable=True)  # megatron's jit-compiled squared_relu: same numbers
def test_project_logits_match_transformers_on_a_moe_model(parallel_context, monkeypatch):
    monkeypatch.setattr("nvfp4_recipe.megatron.parallel_linear.COMPUTE_DTYPE", torch.float32)
    torch.manual_seed(0)
    ours = _project_model(TINY)
    with torch.no_grad():  # a trained bias, so the mapping of the choice-only bias shows
        for layer in ours.decoder.layers:
            if hasattr(getattr(layer, "mlp", None), "router"):
                layer.mlp.router.expert_bias.copy_(torch.tensor([0.02, -0.01, 0.0, 0.03]))
    state = hf.to_hf(model_full_tensors(ours), TINY, VOCAB)
    assert state["model.layers.1.mixer.experts.up_proj"].shape == (4, 32, 64)
    assert state["model.layers.1.mixer.gate.weight"].dtype == torch.float32
    theirs = hf_model(TINY, VOCAB)
    theirs.load_state_dict(state, strict=True)
    ids = torch.randint(0, VOCAB, (2, 40))
    with torch.no_grad():
        ours_logits = ours(ids, None, None)[..., :VOCAB]
        hf_logits = theirs(ids).logits
        rel = ((ours_logits - hf_logits).abs().max() / hf_logits.abs().max()).item()
    assert rel < LOGITS_RTOL
    # the bias changes which experts are chosen: without it the logits are another model's
    zero = {k: (torch.zeros_like(v) if k.endswith("e_score_correction_bias") else v)
            for k, v in state.items()}
    theirs.load_state_dict(zero, strict=True)
    with torch.no_grad():
        moved = ((theirs(ids).logits - hf_logits).abs().max() / hf_logits.abs().max()).item()
    assert moved > 100 * LOGITS_RTOL


def test_transformers_to_project_to_transformers_is_bit_identical_for_moe(parallel_context,
                                                                          tmp_path):
    from transformers import AutoModelForCausalLM

    from hf_helpers import rewrite_tensors

    hf_dir, original = random_hf_dir(tmp_path, TINY, VOCAB)
    for i in (1, 3):  # a trained expert bias (transformers initialises it to zeros)
        bias = torch.tensor([0.01, -0.02, 0.03, 0.0]) * i
        rewrite_tensors(hf_dir, lambda t: t[f"backbone.layers.{i}.mixer.gate."
                                            "e_score_correction_bias"].copy_(bias))
        # stored in the helper's BF16, as the cast model held it
        original[f"model.layers.{i}.mixer.gate.e_score_correction_bias"] = bias.bfloat16()
    stored = load_safetensors(hf_dir)
    # transformers stores one tensor per routed expert, as NVIDIA's checkpoints do
    assert "backbone.layers.1.mixer.experts.3.down_proj.weight" in stored
    assert not any(k.endswith("experts.up_proj") for k in stored)
    cfg = dataclasses.replace(TINY, init_from=str(hf_dir))
    hf.check_init_from(cfg)
    ours = _project_model(cfg, torch.bfloat16)
    hf.load_hf_weights(ours, cfg, VOCAB)
    ours.to(torch.bfloat16)  # Float16Module's cast; the router and its bias stay FP32
    back = hf.to_hf(model_full_tensors(ours), cfg, VOCAB)
    assert back.keys() == original.keys()
    for name, tensor in original.items():
        # the router stays FP32, as transformers keeps it (the helper's BF16 cast did not)
        dtype = torch.float32 if name.endswith(hf._FP32_HF_TENSORS) else tensor.dtype
        assert back[name].dtype == dtype and torch.equal(back[name], tensor.to(dtype)), name

    config = hf.hf_config(cfg, VOCAB, eos_token_id=0, pad_token_id=0)
    hf.write_hf_dir(tmp_path / "hf_out", config, back, tokenizer=None)
    written = load_safetensors(tmp_path / "hf_out")
    assert written.keys() == stored.keys()  # the per-expert names transformers writes
    fields = json.loads((tmp_path / "hf_out" / "config.json").read_text())
    assert fields["hybrid_override_pattern"] == "ME*E-"
    assert (fields["n_routed_experts"], fields["num_experts_per_tok"],
            fields["routed_scaling_factor"], fields["norm_topk_prob"]) == (4, 2, 2.5, True)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_out").state_dict()
    assert all(torch.equal(reloaded[k], v.to(reloaded[k].dtype)) for k, v in original.items())


@pytest.mark.parametrize("change, named", [
    (dict(score_function="softmax", expert_bias=False),
     "model.moe.score_function=softmax: transformers' NemotronH routes with sigmoid scores only"),
    (dict(shared_expert_ffn_hidden_size=None),
     "model.moe.shared_expert_ffn_hidden_size=null: transformers' NemotronH MoE layers always"),
])
def test_moe_layers_without_a_hugging_face_form_are_refused(tmp_path, change, named):
    cfg = dataclasses.replace(TINY, moe=dataclasses.replace(MOE, **change))
    with pytest.raises(hf.HFError, match="^the Hugging Face export: " + named):
        hf.hf_config_fields(cfg, VOCAB, eos_token_id=0)
    hf_dir, _ = random_hf_dir(tmp_path, TINY, VOCAB)
    with pytest.raises(hf.HFError, match=f"^model.init_from={hf_dir}: " + named):
        hf.check_init_from(dataclasses.replace(cfg, init_from=str(hf_dir)))


def test_a_checkpoint_with_other_routing_is_refused_naming_each_field(tmp_path):
    hf_dir, _ = random_hf_dir(tmp_path, TINY, VOCAB)
    cfg = dataclasses.replace(TINY, init_from=str(hf_dir), moe=dataclasses.replace(
        MOE, topk=1, topk_scaling_factor=None))
    with pytest.raises(hf.HFError) as err:
        hf.check_init_from(cfg)
    message = str(err.value)
    assert "num_experts_per_tok=1 (model.moe) but the checkpoint's 2" in message
    assert "routed_scaling_factor=1.0 (model.moe) but the checkpoint's 2.5" in message
    assert "norm_topk_prob=False (model.moe) but the checkpoint's True" in message


def test_a_missing_expert_is_refused_from_the_headers(tmp_path):
    hf_dir, _ = random_hf_dir(tmp_path, TINY, VOCAB)
    from hf_helpers import rewrite_tensors

    rewrite_tensors(hf_dir, lambda t: t.pop("backbone.layers.3.mixer.experts.2.up_proj.weight"))
    with pytest.raises(hf.HFError, match="no model.layers.3.mixer.experts.2.up_proj.weight"):
        hf.check_init_from(dataclasses.replace(TINY, init_from=str(hf_dir)))


def test_a_nonzero_bias_into_a_model_without_one_is_refused(parallel_context, tmp_path):
    from hf_helpers import rewrite_tensors

    hf_dir, _ = random_hf_dir(tmp_path, TINY, VOCAB)
    bias = "backbone.layers.1.mixer.gate.e_score_correction_bias"
    rewrite_tensors(hf_dir, lambda t: t[bias].fill_(0.01))
    cfg = dataclasses.replace(TINY, init_from=str(hf_dir),
                              moe=dataclasses.replace(MOE, expert_bias=False))
    with pytest.raises(hf.HFError, match="layer 1's e_score_correction_bias is not zero but "
                                         "model.moe.expert_bias=false"):
        hf.load_hf_weights(_project_model(cfg, torch.bfloat16), cfg, VOCAB)

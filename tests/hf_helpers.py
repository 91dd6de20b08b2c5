"""Hugging Face directories the tests of both tiers make and break (model/hf.py, model.init_from,
tools/hf_export.py): a random transformers NemotronH model saved as safetensors, a cut file, a
single-file export's tensors rewritten, and an export's tensors read back under their saved keys."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from model.config import MoEConfig

# Nemotron 3's routing at test size, for the MoE round trips and exports: sigmoid scores, the
# expert bias, top-2 of 4 experts of 32, normalised and scaled by 2.5, a shared expert of 48.
TINY_MOE = MoEConfig(num_experts=4, topk=2, ffn_hidden_size=32, shared_expert_ffn_hidden_size=48,
                     score_function="sigmoid", topk_scaling_factor=2.5, expert_bias=True)


def hf_model(cfg, vocab: int, dtype=torch.float32, **config_overrides):
    """A transformers NemotronH model of the project's ModelConfig `cfg` (transformers' own inits)."""
    from transformers import NemotronHForCausalLM

    from model import hf

    config = hf.hf_config(cfg, vocab, eos_token_id=0, pad_token_id=0,
                          dtype=str(dtype).removeprefix("torch."))
    for key, value in config_overrides.items():
        setattr(config, key, value)
    return NemotronHForCausalLM(config).to(dtype).eval()


def random_hf_dir(tmp_path: Path, cfg, vocab: int, **save_kwargs) -> tuple:
    """A BF16 transformers model with every tensor random (not transformers' constant inits),
    saved as safetensors; returns (dir, its state dict)."""
    torch.manual_seed(1)
    model = hf_model(cfg, vocab, torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p, dtype=torch.float32) * 0.1)
    out = tmp_path / "hf_in"
    model.save_pretrained(out, **save_kwargs)
    return out, {k: v.clone() for k, v in model.state_dict().items()}


def truncate(path: Path, keep: float = 0.5) -> None:
    """Cut `path` to `keep` of its size (a download or copy that stopped)."""
    os.truncate(path, int(path.stat().st_size * keep))


def rewrite_tensors(hf_dir: Path, change) -> None:
    """Rewrite a single-file export's tensors through `change(tensors)`."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(hf_dir / "model.safetensors")
    change(tensors)
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})


def load_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the *.safetensors files in `directory` (an export, sharded or not)."""
    from safetensors.torch import load_file

    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def saved_key(name: str) -> str:
    """The key transformers 5 saves a NemotronH tensor under: its body as backbone.*, which it
    names model.* once loaded."""
    return "backbone." + name[len("model."):] if name.startswith("model.") else name


def trained_weights_and_amax(cfg, prec, vocab: int) -> tuple[dict, dict]:
    """(BF16 checkpoint tensors, the input-amax recorder's state) after two steps of forwards of an
    emulated `cfg` model under `prec`: what an export of a trained run reads."""
    from helpers import model_full_tensors
    from model.build import build_model
    from nvfp4_recipe.megatron.input_amax import InputAmaxRecorder

    torch.manual_seed(0)
    built = build_model(cfg, prec, vocab_size=vocab, backend="emulated",
                        params_dtype=torch.bfloat16)
    model = built.module.eval()
    names = [n for n, fmt in built.policy.linear_formats().items() if fmt != "bf16"]
    recorder = InputAmaxRecorder(names, built.linears, 4)
    with torch.no_grad():
        for _ in range(2):
            model(torch.randint(0, vocab, (2, 32)), None, None)
            recorder.end_step()
    return {k: v.clone() for k, v in model_full_tensors(model).items()}, recorder.state_dict()


def write_export_run(root: Path, cfg, tokenizer: str, weights, amax_state, prec,
                     monkeypatch) -> Path:
    """A run directory of model `cfg` trained under `prec` for tools.hf_export to read: its
    config.yaml and a step-4 checkpoint whose weights `weights` are (the checkpoint reader is
    patched to return them)."""
    import dataclasses
    import json

    from tools import hf_export

    run = root / "run"
    ckpt = run / "checkpoints" / "step_0000004"
    ckpt.mkdir(parents=True)
    (ckpt / "manifest.json").write_text(json.dumps({"step": 4}))
    torch.save({"step": 4, "consumed_tokens": 256, "input_amax": amax_state}, ckpt / "trainer.pt")
    prec_fields = {k: (str(v) if hasattr(v, "value") else v)
                   for k, v in dataclasses.asdict(prec).items() if k != "switch_to_bf16"}
    config = {"model": {k: (str(v) if k == "spec" else v)
                        for k, v in dataclasses.asdict(cfg).items()},
              "precision": prec_fields, "data": {"tokenizer": tokenizer},
              "trainer": {"max_steps": 4, "global_batch_size": 2, "seq_length": 32}}
    (run / "config.yaml").write_text(json.dumps(config))
    monkeypatch.setattr(hf_export, "pick_checkpoint", lambda run_dir, step: ckpt)
    monkeypatch.setattr(hf_export, "read_checkpoint_weights", lambda checkpoint: weights)
    return run

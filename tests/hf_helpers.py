"""Hugging Face directories the tests of both tiers make and break (model/hf.py, model.init_from,
tools/hf_export.py): a random transformers NemotronH model saved as safetensors, a cut file, a
single-file export's tensors rewritten, and an export's tensors read back under their saved keys."""

from __future__ import annotations

import os
from pathlib import Path

import torch


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

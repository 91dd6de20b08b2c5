"""Atomic checkpoints in run.dir/checkpoints/step_XXXXXXX, verified on load.

Layout of one checkpoint:
  dist/                  BF16 model weights + FP32 master weights and Adam moments, a megatron-core
                         distributed checkpoint (torch_dist): every tensor keyed by its global
                         shape and offset, the optimizer's by its parameter's (megatron's
                         'fully_reshardable' layout), so it loads into any tensor/pipeline/data
                         layout written by the same kind of optimizer (manifest: optimizer_format)
  rng_rank{r}.pt         each rank's RNG state (stochastic rounding draws from it)
  trainer.pt             step, scheduler, data-loader state, W&B id, counters (rank 0)
  manifest.json          every file's size and SHA-256 and the layout; written last
Each checkpoint is written into a hidden temporary directory and renamed into place only
after every rank finished, so a crash leaves either a complete checkpoint or none. Loading
verifies the manifest and falls back to the previous checkpoint if the latest is torn.
Everything is loaded with `torch.load(weights_only=True)`: no code runs from a checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

from .distributed import ParallelContext, barrier

log = logging.getLogger("nvfp4_pretrain")

PREFIX = "step_"
MANIFEST = "manifest.json"


def step_dir_name(step: int) -> str:
    return f"{PREFIX}{step:07d}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _broadcast_str(value: str, ctx: ParallelContext) -> str:
    import torch.distributed as dist

    if ctx.world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# megatron's distributed optimizer: the format that reshards over data parallel as well
# (`distrib_optimizer.py:1175-1293`, core 0.16.1); the CPU twin writes the same layout.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _sharded_state(model: torch.nn.Module, optimizer, is_loading: bool) -> dict:
    """Model and optimizer state as megatron ShardedTensors (the optimizer's keyed like its params).

    `model` is the unwrapped megatron model: megatron's DDP would prefix every key with
    "module." (as Megatron-LM, which unwraps first), and keys must not depend on the device.
    """
    model_state = model.sharded_state_dict()
    optim_state = optimizer.sharded_state_dict(model_state, is_loading=is_loading,
                                               metadata=OPTIMIZER_METADATA)
    return {"model": model_state, "optimizer": optim_state}


def save_checkpoint(root: Path, step: int, ctx: ParallelContext, *, model: torch.nn.Module,
                    optimizer, optimizer_format: str, trainer_state: dict,
                    keep_last: int) -> Path:
    from megatron.core import dist_checkpointing

    from model.compat import cpu_dist_checkpoint_save

    final = root / step_dir_name(step)
    tmp = root / f".tmp-{step_dir_name(step)}"
    if ctx.is_main:
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / "dist").mkdir(parents=True)
    barrier()
    with cpu_dist_checkpoint_save():
        dist_checkpointing.save(_sharded_state(model, optimizer, is_loading=False),
                                str(tmp / "dist"))
    torch.save({"cpu": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None},
               tmp / f"rng_rank{ctx.rank}.pt")
    if ctx.is_main:
        torch.save(trainer_state, tmp / "trainer.pt")
    barrier()
    if ctx.is_main:
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        manifest = {"step": step, "world_size": ctx.world_size, "tensor": ctx.tensor,
                    "pipeline": ctx.pipeline, "optimizer_format": optimizer_format,
                    "files": {str(p.relative_to(tmp)): {"bytes": p.stat().st_size,
                                                        "sha256": _sha256(p)}
                              for p in files}}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if final.exists():  # a re-save of the same step (e.g. after a resume)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _apply_retention(root, keep_last)
    barrier()
    return final


def _apply_retention(root: Path, keep_last: int) -> None:
    if keep_last <= 0:
        return
    complete = [d for d in sorted(root.glob(f"{PREFIX}*")) if (d / MANIFEST).exists()]
    for old in complete[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def verify_checkpoint(path: Path) -> Optional[str]:
    """None if the checkpoint is complete and intact, else what is wrong with it."""
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        return "no manifest (the write never finished)"
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as exc:
        return f"unreadable manifest ({exc})"
    for name, meta in manifest["files"].items():
        file = path / name
        if not file.exists():
            return f"missing {name}"
        if file.stat().st_size != meta["bytes"]:
            return f"{name} has {file.stat().st_size} bytes, expected {meta['bytes']}"
        if _sha256(file) != meta["sha256"]:
            return f"{name} does not match its checksum"
    return None


def latest_valid_checkpoint(root: Path) -> Optional[Path]:
    """The newest intact checkpoint; torn or corrupt newer ones are reported and skipped."""
    if not root.exists():
        return None
    for candidate in sorted(root.glob(f"{PREFIX}*"), reverse=True):
        problem = verify_checkpoint(candidate)
        if problem is None:
            return candidate
        log.warning(f"checkpoint {candidate.name} is unusable: {problem}; trying an older one")
    return None


def find_resume_checkpoint(root: Path, ctx: ParallelContext) -> Optional[Path]:
    """Rank 0 picks (and verifies) the checkpoint; every rank loads the same one."""
    chosen = ""
    if ctx.is_main:
        found = latest_valid_checkpoint(root)
        chosen = str(found) if found else ""
    chosen = _broadcast_str(chosen, ctx)
    return Path(chosen) if chosen else None


def load_checkpoint(path: Path, ctx: ParallelContext, model: torch.nn.Module,
                    optimizer, optimizer_format: str) -> dict[str, Any]:
    """Load model and optimizer in place (any TP/PP/DP layout); return trainer state and RNG.

    `model` is the unwrapped megatron model whose parameters the optimizer was built on.
    """
    from megatron.core import dist_checkpointing

    manifest = json.loads((path / MANIFEST).read_text())
    saved_format = manifest.get("optimizer_format", optimizer_format)
    if saved_format != optimizer_format:
        raise ValueError(
            f"checkpoint {path} holds optimizer state in the {saved_format!r} layout and this "
            f"run writes {optimizer_format!r}: resume on the same kind of device with the same "
            "trainer.distributed_optimizer (on GPUs megatron's two optimizers differ)")
    trainer = torch.load(path / "trainer.pt", weights_only=True)
    loaded = dist_checkpointing.load(_sharded_state(model, optimizer, is_loading=True),
                                     str(path / "dist"))
    missing, unexpected = model.load_state_dict(loaded["model"], strict=False)
    real_missing = [k for k in missing if not k.endswith("_extra_state")]
    if real_missing or unexpected:
        raise ValueError(f"checkpoint {path} does not fit this model: missing {real_missing}, "
                         f"unexpected {unexpected}")
    optimizer.load_state_dict(loaded["optimizer"])
    same_layout = manifest["world_size"] == ctx.world_size and (
        manifest["tensor"], manifest["pipeline"]) == (ctx.tensor, ctx.pipeline)
    rng_file = path / f"rng_rank{ctx.rank}.pt"
    # Another layout draws other stochastic-rounding streams anyway: keep the fresh RNG then.
    rng = torch.load(rng_file, weights_only=True) if same_layout and rng_file.exists() else None
    return {"trainer": trainer, "rng": rng, "resharded": not same_layout,
            "layout": (manifest["tensor"], manifest["pipeline"], manifest["world_size"])}

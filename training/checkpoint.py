"""Atomic checkpoints in run.dir/checkpoints/step_XXXXXXX, verified on load.

Layout of one checkpoint:
  model_tp{t}_pp{p}.pt   model + optimizer shard (written by data-parallel rank 0)
  rng_rank{r}.pt         each rank's RNG state (stochastic rounding draws from it)
  trainer.pt             step, scheduler, data-loader state, W&B id, counters (rank 0)
  manifest.json          every file's size and SHA-256; written last
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


def save_checkpoint(root: Path, step: int, ctx: ParallelContext, *, model_state: dict,
                    optimizer_state: dict, trainer_state: dict, keep_last: int) -> Path:
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{step_dir_name(step)}"
    if ctx.is_main:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    barrier()
    if ctx.data_rank == 0:
        torch.save({"model": model_state, "optimizer": optimizer_state},
                   tmp / f"model_tp{ctx.tensor_rank}_pp{ctx.pipeline_rank}.pt")
    torch.save({"cpu": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None},
               tmp / f"rng_rank{ctx.rank}.pt")
    if ctx.is_main:
        torch.save(trainer_state, tmp / "trainer.pt")
    barrier()
    if ctx.is_main:
        files = sorted(p for p in tmp.iterdir() if p.is_file())
        manifest = {"step": step, "world_size": ctx.world_size, "tensor": ctx.tensor,
                    "pipeline": ctx.pipeline,
                    "files": {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
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


def load_checkpoint(path: Path, ctx: ParallelContext) -> dict[str, Any]:
    manifest = json.loads((path / MANIFEST).read_text())
    if (manifest["tensor"], manifest["pipeline"]) != (ctx.tensor, ctx.pipeline):
        raise ValueError(
            f"checkpoint {path} was written with tensor={manifest['tensor']} "
            f"pipeline={manifest['pipeline']}, this run uses tensor={ctx.tensor} "
            f"pipeline={ctx.pipeline}; resume with the same layout"
        )
    shard = torch.load(path / f"model_tp{ctx.tensor_rank}_pp{ctx.pipeline_rank}.pt",
                       weights_only=True, map_location="cpu")
    trainer = torch.load(path / "trainer.pt", weights_only=True)
    rng_file = path / f"rng_rank{ctx.rank}.pt"
    rng = torch.load(rng_file, weights_only=True) if rng_file.exists() else None
    return {"model": shard["model"], "optimizer": shard["optimizer"], "trainer": trainer,
            "rng": rng}

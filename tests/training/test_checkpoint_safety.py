"""No code runs from a checkpoint, no run is silently thrown away, no resume ends in a traceback.

Fast tests work on small checkpoints written in-process; the slow ones run train.py on a real
checkpoint as a user (or a Slurm requeue) would.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from train_helpers import FAST, run_train
from training.metrics import read_metrics

from training.checkpoint import (MANIFEST, NoUsableCheckpoint, _apply_retention,
                                 find_resume_checkpoint, set_aside_for_restart)
from training.distributed import ParallelContext
from training.safe_load import CheckpointRefused, load_dist_checkpoint, read_metadata_safely

SINGLE = ParallelContext(world_size=1, rank=0, tensor=1, pipeline=1, data=1, tensor_rank=0,
                         pipeline_rank=0, data_rank=0, device=torch.device("cpu"))


class _RunsCode:
    """Unpickling this runs `touch MARKER`: what a crafted .metadata does to a plain pickle.load."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _rehash(checkpoint: Path, name: str) -> None:
    """Update the manifest as an attacker who can write the run directory would."""
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    data = (checkpoint / name).read_bytes()
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))


def _snapshot(root: Path) -> dict:
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# -- fast: in-process ------------------------------------------------------------------------


def test_crafted_metadata_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(CheckpointRefused) as err:
        read_metadata_safely(path)
    assert not marker.exists()
    message = str(err.value)
    assert str(path) in message and "posix.system" in message and "\n" not in message
    # what torch's own FileSystemReader would have done with it (filesystem.py:930)
    pickle.loads(path.read_bytes())
    assert marker.exists()


def _save_small_dist_checkpoint(directory: Path) -> dict:
    """A megatron torch_dist checkpoint with a tensor, a ShardedObject and common state."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    from compat import cpu_dist_checkpoint_save

    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = {"w": ShardedTensor.from_rank_offsets("w", weight.clone()),
             "extra": ShardedObject("extra", [torch.ones(2)], (1,), (0,), replica_id=0),
             "step": 7}
    directory.mkdir(parents=True)
    with cpu_dist_checkpoint_save(cuda=False):
        dist_checkpointing.save(state, str(directory))
    return {"w": weight}


def _load_small(directory: Path) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    template = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4)),
                "extra": ShardedObject("extra", None, (1,), (0,), replica_id=0)}
    return load_dist_checkpoint(template, directory)  # what training/checkpoint.py calls


def test_safe_strategies_load_what_megatron_saved(tmp_path, parallel_context):
    expected = _save_small_dist_checkpoint(tmp_path / "dist")
    loaded = _load_small(tmp_path / "dist")
    assert torch.equal(loaded["w"], expected["w"])
    assert torch.equal(loaded["extra"][0], torch.ones(2)) and loaded["step"] == 7


def test_safe_strategies_refuse_code_in_metadata_common_state_and_objects(
        tmp_path, parallel_context):
    marker = tmp_path / "pwned"
    good = tmp_path / "good"
    _save_small_dist_checkpoint(good)
    # .metadata: plain pickle in torch; common.pt: torch.load without weights_only in megatron
    for name in (".metadata", "common.pt"):
        bad = tmp_path / name.strip(".")
        shutil.copytree(good, bad)
        if name == "common.pt":
            torch.save({"step": _RunsCode(marker)}, bad / name)
        else:
            (bad / name).write_bytes(pickle.dumps(_RunsCode(marker)))
        with pytest.raises(CheckpointRefused, match=str(bad / name)):
            _load_small(bad)
        assert not marker.exists(), name
    # a ShardedObject in a .distcp file: torch.load(weights_only=False) in torch's planner
    bad = tmp_path / "object"
    shutil.copytree(good, bad)
    payload = io.BytesIO()
    torch.save(_RunsCode(marker), payload)
    _replace_item(bad, "extra", payload.getvalue())
    with pytest.raises(CheckpointRefused, match="extra"):
        _load_small(bad)
    assert not marker.exists()


def _replace_item(directory: Path, fqn_prefix: str, data: bytes) -> None:
    """Swap one item's bytes in its .distcp file, re-laying that file out (and the metadata)."""
    metadata = read_metadata_safely(directory / ".metadata")
    key = next(k for k in metadata.storage_data if k.fqn.startswith(fqn_prefix))
    file = metadata.storage_data[key].relative_path
    old = (directory / file).read_bytes()
    items = sorted(((k, v) for k, v in metadata.storage_data.items() if v.relative_path == file),
                   key=lambda kv: kv[1].offset)
    out = bytearray()
    for k, info in items:
        chunk = data if k == key else old[info.offset:info.offset + info.length]
        info.offset, info.length = len(out), len(chunk)
        out += chunk
    (directory / file).write_bytes(bytes(out))
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))


def test_transformer_engine_extra_state_is_vetted_before_te_unpickles_it(tmp_path, monkeypatch):
    """TE's set_extra_state `pickle.loads` a uint8 tensor: only its recipe classes may be named."""
    import dataclasses
    import sys
    import types

    from training.safe_load import vet_extra_state

    # A stand-in for transformer_engine.common.recipe (TE is not installed on CPU machines).
    recipe_module = types.ModuleType("transformer_engine.common.recipe")

    @dataclasses.dataclass
    class NVFP4BlockScaling:
        disable_rht: bool = False

    NVFP4BlockScaling.__module__ = recipe_module.__name__
    NVFP4BlockScaling.__qualname__ = "NVFP4BlockScaling"
    recipe_module.NVFP4BlockScaling = NVFP4BlockScaling
    for name in ("transformer_engine", "transformer_engine.common"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, recipe_module.__name__, recipe_module)

    def as_extra_state(obj) -> torch.Tensor:  # what TE's get_extra_state returns
        return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)

    good = {"recipe": NVFP4BlockScaling(), "extra_fp8_variables": {"num_gemms": 1}}
    prefix = "decoder.layers.0.mlp."
    vet_extra_state({prefix + "linear_fc1._extra_state": as_extra_state(good),
                     prefix + "linear_fc2._extra_state": torch.empty(0, dtype=torch.uint8),
                     prefix + "linear_fc1.weight": torch.ones(2)}, tmp_path)
    marker = tmp_path / "pwned"
    bad = {"decoder.layers.0.mlp.linear_fc1._extra_state": as_extra_state(
        {"recipe": _RunsCode(marker)})}
    with pytest.raises(CheckpointRefused, match="linear_fc1._extra_state.*posix.system"):
        vet_extra_state(bad, tmp_path)
    assert not marker.exists()


def _fake_checkpoint(root: Path, step: int, skipped_since_previous: int = 0,
                     corrupt: bool = False) -> Path:
    path = root / f"step_{step:07d}"
    path.mkdir(parents=True)
    (path / "trainer.pt").write_bytes(b"x")
    digest = hashlib.sha256(b"y" if corrupt else b"x").hexdigest()
    (path / MANIFEST).write_text(json.dumps(
        {"step": step, "skipped_since_previous": skipped_since_previous,
         "files": {"trainer.pt": {"bytes": 1, "sha256": digest}}}))
    return path


def test_no_usable_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    assert find_resume_checkpoint(tmp_path / "none", SINGLE) is None  # a new run
    for step in (2, 4):
        _fake_checkpoint(tmp_path, step, corrupt=True)
    (tmp_path / "step_0000006").mkdir()  # torn
    before = _snapshot(tmp_path)
    with pytest.raises(NoUsableCheckpoint) as err:
        find_resume_checkpoint(tmp_path, SINGLE)
    assert "none is usable" in str(err.value) and "run.resume=restart" in str(err.value)
    assert _snapshot(tmp_path) == before


def test_unlisted_files_make_a_checkpoint_unusable(tmp_path):
    path = _fake_checkpoint(tmp_path, 2)
    assert find_resume_checkpoint(tmp_path, SINGLE) == path
    (path / "dist").mkdir()
    (path / "dist" / ".metadata").write_bytes(b"not in the manifest")
    with pytest.raises(NoUsableCheckpoint):
        find_resume_checkpoint(tmp_path, SINGLE)


def test_restart_moves_old_checkpoints_aside_and_deletes_nothing(tmp_path):
    for step in (2, 4):
        _fake_checkpoint(tmp_path, step, corrupt=True)
    before = {p.name: _snapshot(p) for p in tmp_path.iterdir()}
    moved = set_aside_for_restart(tmp_path, SINGLE)
    assert moved.parent == tmp_path and moved.name.startswith("abandoned-")
    assert not list(tmp_path.glob("step_*"))
    assert {p.name: _snapshot(p) for p in moved.iterdir()} == before
    assert find_resume_checkpoint(tmp_path, SINGLE) is None  # abandoned ones are not resumed


def test_checkpoints_after_skipped_steps_never_evict_the_last_clean_one(tmp_path):
    _fake_checkpoint(tmp_path, 1)
    _fake_checkpoint(tmp_path, 2)
    for step in (3, 4, 5):
        _fake_checkpoint(tmp_path, step, skipped_since_previous=1)
    _apply_retention(tmp_path, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_0000002", "step_0000004", "step_0000005"]
    _fake_checkpoint(tmp_path, 6)  # clean again: the newest clean one now
    _apply_retention(tmp_path, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000005", "step_0000006"]


# -- slow: train.py on a real checkpoint -------------------------------------------------------

ARGS = [*FAST, "precision=bf16", "trainer.save_every=1", "trainer.eval_every=100",
        "trainer.keep_last=10"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_cache) -> Path:
    """A run directory with checkpoints at steps 1 and 2."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    proc = run_train(run_dir, *ARGS, "trainer.max_steps=2", cache_dir=data_cache)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run_dir


def _copy(trained: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    return run_dir


@pytest.mark.slow
def test_resume_refuses_a_crafted_metadata_and_runs_nothing(trained, tmp_path, data_cache):
    run_dir = _copy(trained, tmp_path)
    marker = tmp_path / "pwned"
    newest = run_dir / "checkpoints" / "step_0000002"
    (newest / "dist" / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    _rehash(newest, "dist/.metadata")
    before = _snapshot(run_dir / "checkpoints")
    proc = run_train(run_dir, *ARGS, "trainer.max_steps=3", cache_dir=data_cache)
    log = proc.stdout + proc.stderr
    assert not marker.exists(), log
    assert proc.returncode == 6, log
    assert f"refusing {newest / 'dist' / '.metadata'}" in log and "Traceback" not in log
    assert _snapshot(run_dir / "checkpoints") == before


@pytest.mark.slow
def test_every_checkpoint_corrupt_stops_with_exit_6_until_restart_is_chosen(
        trained, tmp_path, data_cache):
    run_dir = _copy(trained, tmp_path)
    for checkpoint in (run_dir / "checkpoints").glob("step_*"):
        shard = checkpoint / "dist" / "__0_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    checkpoints = _snapshot(run_dir / "checkpoints")
    metrics = (run_dir / "metrics.jsonl").read_text()
    proc = run_train(run_dir, *ARGS, "trainer.max_steps=3", cache_dir=data_cache)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 6, log
    assert "none is usable" in log and "run.resume=restart" in log and "Traceback" not in log
    assert _snapshot(run_dir / "checkpoints") == checkpoints  # nothing deleted or replaced
    assert (run_dir / "metrics.jsonl").read_text() == metrics  # no second step 1

    proc = run_train(run_dir, *ARGS, "trainer.max_steps=1", "run.resume=restart",
                     cache_dir=data_cache)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    abandoned = list((run_dir / "checkpoints").glob("abandoned-*"))
    assert len(abandoned) == 1 and _snapshot(abandoned[0]) == checkpoints
    assert (run_dir / "checkpoints" / "step_0000001" / MANIFEST).exists()
    events = [m for m in read_metrics(run_dir) if m.get("event") == "restart"]
    assert len(events) == 1


@pytest.mark.slow
def test_resume_with_another_model_shape_is_one_line_and_exit_2(trained, tmp_path, data_cache):
    run_dir = _copy(trained, tmp_path)
    proc = run_train(run_dir, *ARGS, "trainer.max_steps=3", "model.hidden_size=128",
                     cache_dir=data_cache)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 2, log
    assert "does not fit this model" in log and "Traceback" not in log
    line = next(line for line in log.splitlines() if "does not fit this model" in line)
    assert "shape mismatch" in line and len(line) < 600


@pytest.mark.slow
def test_consecutive_skips_stop_the_run_and_keep_the_last_clean_checkpoint(tmp_path, data_cache):
    run_dir = tmp_path / "run"
    # An absurd learning rate without clipping: step 1 updates, every later loss is not finite.
    proc = run_train(run_dir, *ARGS, "trainer.max_steps=8", "trainer.keep_last=1",
                     "trainer.lr=1e12", "trainer.grad_clip=0", "trainer.warmup_steps=0",
                     "trainer.on_nan=skip", "trainer.max_consecutive_skips=3",
                     cache_dir=data_cache)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 4, log
    assert "3 steps in a row (trainer.max_consecutive_skips=3)" in log
    metrics = [m for m in read_metrics(run_dir) if "loss" in m]
    assert [m["step"] for m in metrics] == [1, 2, 3] and metrics[-1]["skipped_steps"] == 2
    kept = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    # keep_last=1 keeps step 3 (written after skipped steps) and the last clean one, step 1
    assert kept == ["step_0000001", "step_0000003"], kept
    manifest = json.loads((run_dir / "checkpoints" / "step_0000001" / MANIFEST).read_text())
    assert manifest["skipped_since_previous"] == 0

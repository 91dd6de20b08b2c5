"""No code runs from a checkpoint, no run is silently thrown away, no resume ends in a traceback.

These work on small checkpoints written in-process; train.py on a real checkpoint, as a user (or
a Slurm requeue) runs it: tests/system/test_checkpoint_resume.py.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from helpers import RunsCode, snapshot

from training.checkpoint import (MANIFEST, NoUsableCheckpoint, _apply_retention,
                                 find_resume_checkpoint, set_aside_for_restart)
from training.distributed import ParallelContext
from training.safe_load import CheckpointRefused, load_dist_checkpoint, read_metadata_safely

SINGLE = ParallelContext(world_size=1, rank=0, tensor=1, pipeline=1, data=1, tensor_rank=0,
                         pipeline_rank=0, data_rank=0, device=torch.device("cpu"))


def test_crafted_metadata_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps(RunsCode(marker)))
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
            torch.save({"step": RunsCode(marker)}, bad / name)
        else:
            (bad / name).write_bytes(pickle.dumps(RunsCode(marker)))
        with pytest.raises(CheckpointRefused, match=str(bad / name)):
            _load_small(bad)
        assert not marker.exists(), name
    # a ShardedObject in a .distcp file: torch.load(weights_only=False) in torch's planner
    bad = tmp_path / "object"
    shutil.copytree(good, bad)
    payload = io.BytesIO()
    torch.save(RunsCode(marker), payload)
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
        {"recipe": RunsCode(marker)})}
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
    before = snapshot(tmp_path)
    with pytest.raises(NoUsableCheckpoint) as err:
        find_resume_checkpoint(tmp_path, SINGLE)
    assert "none is usable" in str(err.value) and "run.resume=restart" in str(err.value)
    assert snapshot(tmp_path) == before


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
    before = {p.name: snapshot(p) for p in tmp_path.iterdir()}
    moved = set_aside_for_restart(tmp_path, SINGLE)
    assert moved.parent == tmp_path and moved.name.startswith("abandoned-")
    assert not list(tmp_path.glob("step_*"))
    assert {p.name: snapshot(p) for p in moved.iterdir()} == before
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

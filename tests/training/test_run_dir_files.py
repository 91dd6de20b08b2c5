"""Never destroy what the user has: the lock and every file the run writes refuse to
be turned on other files, a checkpoint's name is checked against its manifest, a full disk or a
signal during a save ends in one line and a documented exit code, and a torn metrics line is
ended before anything is appended to it.

These work in-process; train.py refusing at start-up, running out of disk or stopped by a
signal during a save: tests/system/test_run_dir_faults.py.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
from pathlib import Path

import pytest
import torch
from helpers import victim_file
from training.metrics import METRICS_FILE, MetricsSink, read_metrics

from training.checkpoint import (MANIFEST, _apply_retention, latest_valid_checkpoint,
                                 verify_checkpoint)
from training.distributed import ParallelContext

SINGLE = ParallelContext(world_size=1, rank=0, tensor=1, pipeline=1, data=1, tensor_rank=0,
                         pipeline_rank=0, data_rank=0, device=torch.device("cpu"))


# -- the lock, and every other file the run writes into run.dir -------------------------------


@pytest.mark.parametrize("plant", ["symlink", "hard_link", "dangling_symlink"])
def test_a_lock_that_is_a_link_is_refused_and_its_target_untouched(tmp_path, plant):
    from training.run_dir import UnsafeFile, lock_run_dir, release_run_dir

    victim, before = victim_file(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lock = run_dir / ".lock"
    if plant == "symlink":
        lock.symlink_to(victim)
    elif plant == "hard_link":
        os.link(victim, lock)
    else:
        lock.symlink_to(tmp_path / "created-through-the-link")
    try:
        with pytest.raises(UnsafeFile) as err:
            lock_run_dir(run_dir)
    finally:
        release_run_dir(run_dir)
    message = str(err.value)
    assert str(lock) in message and "\n" not in message
    assert ("symbolic link" in message) if "symlink" in plant else ("2 hard links" in message)
    assert victim.read_bytes() == before
    assert not (tmp_path / "created-through-the-link").exists()


@pytest.mark.parametrize("plant", ["directory", "fifo", "another_users"])
def test_a_lock_that_is_not_a_regular_file_of_this_user_is_refused(tmp_path, plant):
    from training.run_dir import UnsafeFile, lock_run_dir, release_run_dir

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lock = run_dir / ".lock"
    if plant == "directory":
        lock.mkdir()
    elif plant == "fifo":
        os.mkfifo(lock)
    else:
        if os.geteuid() != 0:
            pytest.skip("making a file of another user needs root")
        lock.write_text("someone else's\n")
        os.chown(lock, 65534, 65534)
    try:
        with pytest.raises(UnsafeFile) as err:
            lock_run_dir(run_dir)
    finally:
        release_run_dir(run_dir)
    expected = {"directory": "not a regular file", "fifo": "not a regular file",
                "another_users": "owned by uid 65534"}[plant]
    assert expected in str(err.value)
    if plant == "another_users":
        assert lock.read_text() == "someone else's\n"


@pytest.mark.parametrize("plant", ["symlink", "hard_link"])
def test_metrics_and_train_log_refuse_links(tmp_path, plant):
    from training.metrics import setup_logging
    from training.run_dir import UnsafeFile

    victim, before = victim_file(tmp_path)
    for name in (METRICS_FILE, "train.log"):
        run_dir = tmp_path / name.replace(".", "-")
        run_dir.mkdir()
        if plant == "symlink":
            (run_dir / name).symlink_to(victim)
        else:
            os.link(victim, run_dir / name)
        root = logging.getLogger()
        handlers, level = list(root.handlers), root.level
        try:
            with pytest.raises(UnsafeFile, match="symbolic link" if plant == "symlink"
                               else "hard links"):
                if name == METRICS_FILE:
                    MetricsSink(run_dir, enabled=True).log(1, {"loss": 1.0})
                else:
                    setup_logging(run_dir, is_main=True)
        finally:
            for handler in list(root.handlers):
                root.removeHandler(handler)
            for handler in handlers:
                root.addHandler(handler)
            root.setLevel(level)
        assert victim.read_bytes() == before


def _prepare(run_dir: Path):
    from training.config import LoggerConfig, RunConfig, TrainConfig
    from training.run_dir import release_run_dir
    from training.trainer import prepare_run_dir

    cfg = TrainConfig(run=RunConfig(dir=str(run_dir)), logger=LoggerConfig(mode="disabled"))
    try:
        return prepare_run_dir(cfg, ParallelContext(1, 0, 1, 1, 1, 0, 0, 0, device=None))
    finally:
        release_run_dir(run_dir)


@pytest.mark.parametrize("plant", ["symlink", "dangling_symlink"])
def test_the_config_copy_is_never_written_through_a_link(tmp_path, plant):
    from errors import ExitCode, ProjectError

    victim, before = victim_file(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    target = victim if plant == "symlink" else tmp_path / "created-through-the-link"
    (run_dir / "config.yaml").symlink_to(target)
    with pytest.raises(ProjectError) as err:
        _prepare(run_dir)
    assert err.value.code == ExitCode.UNWRITABLE
    assert "config.yaml" in str(err.value) and "symbolic link" in str(err.value)
    assert victim.read_bytes() == before
    assert not (tmp_path / "created-through-the-link").exists()
    assert not list(run_dir.glob("config.resume-*"))


def test_planted_links_among_checkpoint_temporaries_are_never_followed(tmp_path):
    """A link where the trainer makes its temporary (or one it cleans up) is removed, not
    followed: the directory it points at keeps every file."""
    from training.checkpoint import step_dir_name
    from training.run_dir import remove_stale_checkpoint_temporaries

    outside = tmp_path / "outside"
    (outside / "dist").mkdir(parents=True)
    (outside / "dist" / "keep.bin").write_bytes(b"keep me")
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    (root / ".tmp-step_0000002-deadhost-1").symlink_to(outside)
    assert remove_stale_checkpoint_temporaries(root) == [".tmp-step_0000002-deadhost-1"]
    assert not os.path.lexists(root / ".tmp-step_0000002-deadhost-1")
    assert (outside / "dist" / "keep.bin").read_bytes() == b"keep me"

    # the name this process would write step 2 under
    (root / f".tmp-{step_dir_name(2)}-{os.uname().nodename}-{os.getpid()}").symlink_to(outside)
    from training.checkpoint import _make_temporary

    tmp = _make_temporary(root, 2, SINGLE)
    assert tmp.is_dir() and not tmp.is_symlink() and (tmp / "dist").is_dir()
    assert sorted(p.name for p in outside.rglob("*")) == ["dist", "keep.bin"]


# -- a checkpoint's name against its manifest ------------------------------------------------


def _fake_checkpoint(root: Path, step: int, manifest_step: int | None = None) -> Path:
    path = root / f"step_{step:07d}"
    path.mkdir(parents=True)
    (path / "trainer.pt").write_bytes(b"x")
    (path / MANIFEST).write_text(json.dumps(
        {"step": step if manifest_step is None else manifest_step,
         "files": {"trainer.pt": {"bytes": 1, "sha256": hashlib.sha256(b"x").hexdigest()}}}))
    return path


def test_a_checkpoint_whose_name_is_not_its_manifests_step_is_refused(tmp_path):
    _fake_checkpoint(tmp_path, 2)
    renamed = _fake_checkpoint(tmp_path, 9, manifest_step=4)
    problem = verify_checkpoint(renamed)
    assert problem is not None and "step 4" in problem and "step_0000009" in problem
    assert "\n" not in problem
    assert latest_valid_checkpoint(tmp_path).name == "step_0000002"


def test_the_newest_checkpoint_is_the_highest_step_past_seven_digits(tmp_path):
    for step in (9_999_998, 9_999_999, 10_000_000):
        _fake_checkpoint(tmp_path, step)
    assert latest_valid_checkpoint(tmp_path).name == "step_10000000"
    _apply_retention(tmp_path, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_10000000", "step_9999999"]


def test_retention_neither_counts_nor_deletes_a_renamed_checkpoint(tmp_path):
    for step in (2, 6):
        _fake_checkpoint(tmp_path, step)
    _fake_checkpoint(tmp_path, 9, manifest_step=4)  # step_0000004 renamed
    _apply_retention(tmp_path, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_0000002", "step_0000006", "step_0000009"]


# -- names and full disks on real checkpoints, in-process -------------------------------------


def _small_model(ctx):
    from model.build import build_model
    from model.config import ModelConfig
    from nvfp4_recipe.policy import PrecisionConfig
    from training import ddp_optimizer as mp
    from training.config import TrainerConfig

    torch.manual_seed(0)
    module = build_model(ModelConfig(vocab_size=256, hidden_size=64, ffn_hidden_size=128),
                         PrecisionConfig(name="bf16", format="bf16"), vocab_size=256,
                         backend="emulated", params_dtype=mp.PARAMS_DTYPE).module
    _, optimizer = mp.build_data_parallel_model(module, TrainerConfig(), ctx)
    return module, optimizer, mp.optimizer_checkpoint_format(ctx.device, False)


@pytest.fixture(scope="module")
def small_model(parallel_context):
    return _small_model(parallel_context)


def _save(root: Path, step: int, ctx, small_model) -> Path:
    from training.checkpoint import save_checkpoint

    core, optimizer, format_ = small_model
    return save_checkpoint(root, step, ctx, model=core, optimizer=optimizer,
                           optimizer_format=format_, trainer_state={"step": step}, keep_last=0)


def test_an_intact_checkpoint_of_the_step_being_saved_is_not_called_unusable(
        tmp_path, parallel_context, small_model, caplog):
    first = _save(tmp_path, 2, parallel_context, small_model)
    files = {p.relative_to(first): p.read_bytes() for p in first.rglob("*") if p.is_file()}
    with caplog.at_level(logging.WARNING, logger="nvfp4_pretrain"):
        _save(tmp_path, 2, parallel_context, small_model)
    moved = " ".join(r.getMessage() for r in caplog.records if "moved" in r.getMessage())
    assert "step_0000002" in moved and "unusable" not in moved and "intact" in moved
    (aside,) = tmp_path.glob("abandoned-*")
    assert {p.relative_to(aside / "step_0000002"): p.read_bytes()
            for p in (aside / "step_0000002").rglob("*") if p.is_file()} == files


def test_enospc_in_the_checkpoint_writer_is_one_line_naming_it(
        tmp_path, parallel_context, small_model, monkeypatch):
    """torch's writer runs in forked workers and hands their exception back wrapped twice
    (RuntimeError "Worker failure", then CheckpointException): the errno is found inside."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from training.checkpoint import CheckpointNotWritten

    previous = _save(tmp_path, 2, parallel_context, small_model)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(filesystem_async, "_write_item", disk_full)
    with pytest.raises(CheckpointNotWritten) as err:
        _save(tmp_path, 4, parallel_context, small_model)
    message = str(err.value)
    assert "No space left on device" in message and "step_0000004" in message
    assert "\n" not in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000002"]  # no temporary left
    assert verify_checkpoint(previous) is None


def test_a_full_tmpfs_during_a_checkpoint_is_one_line_and_keeps_the_previous(
        tmp_path, parallel_context, small_model, small_tmpfs):
    from training.checkpoint import CheckpointNotWritten

    probe = _save(tmp_path / "probe", 1, parallel_context, small_model)
    size = sum(p.stat().st_size for p in probe.rglob("*") if p.is_file())
    root = small_tmpfs(f"{size * 3 // 2 // 1024}k")  # room for one checkpoint, not two
    previous = _save(root, 2, parallel_context, small_model)
    with pytest.raises(CheckpointNotWritten) as err:
        _save(root, 4, parallel_context, small_model)
    assert "No space left on device" in str(err.value) and "\n" not in str(err.value)
    assert sorted(p.name for p in root.iterdir()) == ["step_0000002"]
    assert verify_checkpoint(previous) is None


# -- a torn last line of metrics.jsonl --------------------------------------------------------


@pytest.mark.parametrize("tail", ['{"step": 3, "lo', '{"step": 3, "loss": 7.0}'])
def test_a_torn_last_metrics_line_is_ended_before_anything_is_appended(tmp_path, caplog, tail):
    path = tmp_path / METRICS_FILE
    path.write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "loss": 8.0}\n' + tail)
    with caplog.at_level(logging.WARNING, logger="nvfp4_pretrain"):
        sink = MetricsSink(tmp_path, enabled=True)
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert str(path) in warning and "did not end with a newline" in warning
    sink.log(3, {"loss": 6.5})
    text = path.read_text()
    assert text.startswith('{"step": 1, "loss": 9.0}\n{"step": 2, "loss": 8.0}\n' + tail + "\n")
    expected = [1, 2, 3, 3] if tail.endswith("}") else [1, 2, 3]
    assert [r["step"] for r in read_metrics(tmp_path)] == expected
    assert read_metrics(tmp_path)[-1] == {"step": 3, "loss": 6.5}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nvfp4_pretrain"):
        MetricsSink(tmp_path, enabled=True)  # a whole file: nothing to say, nothing changed
    assert not caplog.records and path.read_text() == text

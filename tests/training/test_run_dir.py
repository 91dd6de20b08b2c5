"""The run directory in-process: a dead writer's checkpoint temporaries are removed under the lock,
and only data errors map to the missing-data exit code. train.py on its run directory (the lock
between trainers, each start-up fault's exit code, Ctrl-C): tests/system/test_run_dir_faults.py."""

from __future__ import annotations

import pytest
from train_helpers import FAST, REPO


def test_checkpoint_temporaries_of_a_dead_writer_are_removed_under_the_lock(tmp_path):
    from training.config import LoggerConfig, RunConfig, TrainConfig
    from training.distributed import ParallelContext
    from training.run_dir import release_run_dir
    from training.trainer import prepare_run_dir

    run_dir = tmp_path / "run"
    stale = run_dir / "checkpoints" / ".tmp-step_0000004-deadhost-12345"
    (stale / "dist").mkdir(parents=True)
    (stale / "dist" / "__0_0.distcp").write_bytes(b"half a checkpoint")
    kept = run_dir / "checkpoints" / "step_0000002"
    kept.mkdir()
    cfg = TrainConfig(run=RunConfig(dir=str(run_dir)), logger=LoggerConfig(mode="disabled"))
    ctx = ParallelContext(1, 0, 1, 1, 1, 0, 0, 0, device=None)
    try:
        prepare_run_dir(cfg, ctx)
        assert not stale.exists() and kept.exists()
    finally:
        release_run_dir(run_dir)



def test_only_data_errors_map_to_missing_data(tmp_path, monkeypatch):
    """A FileNotFoundError from anywhere but the data check is not exit 3: in run.dir it is
    exit 8, elsewhere it propagates (a bug, with its traceback)."""
    from hydra import compose, initialize_config_dir
    from training import entry, trainer
    from training.config import register_configs

    register_configs()
    with initialize_config_dir(str(REPO / "recipes"), version_base=None):
        raw = compose("train", overrides=[*FAST, f"run.dir={tmp_path / 'run'}"])

    def failing_trainer(path):
        class Failing:
            def __init__(self, *args, **kwargs):
                raise FileNotFoundError(2, "No such file or directory", str(path))
        return Failing

    monkeypatch.setattr(trainer, "Trainer", failing_trainer(tmp_path / "elsewhere" / "x"))
    with pytest.raises(FileNotFoundError):
        entry.run(raw)
    monkeypatch.setattr(trainer, "Trainer", failing_trainer(tmp_path / "run" / "checkpoints"))
    assert entry.run(raw) == entry.ExitCode.UNWRITABLE

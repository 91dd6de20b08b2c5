"""train.py's start-up in-process (training/entry.py): the launched world size is read before
joining the group, and a TE run refuses a recipe the environment changed. What a fresh process
imports before it refuses, or when megatron's checkpoint writer re-imports train.py in its spawned
helper: tests/system/test_start_up.py."""

from __future__ import annotations

import pytest

from train_helpers import REPO


@pytest.mark.parametrize("env, expected", [
    ({}, 1),
    ({"WORLD_SIZE": "8"}, 1),  # no RANK: not launched by torchrun or srun
    ({"RANK": "3", "WORLD_SIZE": "8"}, 8),
])
def test_the_launched_world_size_is_read_before_joining_the_group(monkeypatch, env, expected):
    from training.distributed import launched_world_size

    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert launched_world_size() == expected


def test_a_te_run_refuses_a_recipe_changed_by_the_environment(parallel_context, monkeypatch,
                                                               tmp_path, data_cache):
    """The start-up on a GPU with TE (the backend stated, as on a Blackwell node): a variable
    that changes TE's NVFP4 recipe stops the run with exit 2 before anything is written."""
    from hydra import compose, initialize_config_dir

    from errors import ConfigError
    from training import entry
    from training.config import register_configs

    monkeypatch.setenv("NVFP4_CACHE", str(data_cache))
    monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", "dequantized")
    monkeypatch.setattr("model.build.choose_backend", lambda *a, **k: ("te", "stated"))
    run_dir = tmp_path / "run"
    register_configs()
    with initialize_config_dir(str(REPO / "recipes"), version_base=None):
        raw = compose("train", overrides=["trainer=fast", "logger=disabled", f"run.dir={run_dir}",
                                          "precision=nvfp4"])
    with pytest.raises(ConfigError, match="NVTE_BACKWARD_OVERRIDE=.dequantized."):
        entry._start_up(raw)
    assert not run_dir.exists()


@pytest.mark.parametrize("dry_run", [False, True])
def test_the_start_up_builds_the_precision_policy_once(monkeypatch, tmp_path, data_cache, dry_run):
    """A start builds the precision policy once (the config check) and hands that object to the
    preflight and the model; a dry run hands it to the plan's meta model and its preflight."""
    from hydra import compose, initialize_config_dir

    from nvfp4_recipe.policy import PrecisionPolicy
    from training import entry
    from training.config import register_configs
    from train_helpers import FAST

    built = []
    init = PrecisionPolicy.__init__

    def counted(self, *args, **kwargs):
        built.append(args[0] if args else kwargs["cfg"])
        init(self, *args, **kwargs)

    monkeypatch.setattr(PrecisionPolicy, "__init__", counted)
    monkeypatch.setenv("NVFP4_CACHE", str(data_cache))
    monkeypatch.setattr("training.trainer.Trainer.fit", lambda self: 0)
    register_configs()
    with initialize_config_dir(str(REPO / "recipes"), version_base=None):
        raw = compose("train", overrides=[*FAST, f"run.dir={tmp_path / 'run'}", "precision=nvfp4",
                                          f"run.dry_run={str(dry_run).lower()}"])
    assert entry.run(raw) == 0
    assert len(built) == 1, f"{len(built)} PrecisionPolicy constructions"
    if dry_run:
        assert (tmp_path / "run" / "plan.json").exists()

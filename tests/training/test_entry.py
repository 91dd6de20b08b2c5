"""train.py's start: what a process imports before it refuses, or when megatron's checkpoint
writer re-imports train.py in its spawned helper (training/entry.py, train.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from train_helpers import REPO


def _modules_after(code: str) -> set[str]:
    """The top-level packages a fresh interpreter has imported after running `code`."""
    probe = code + "\nimport sys\nprint(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return set(proc.stdout.split("\n")[-2].split())


def test_importing_train_py_as_a_module_imports_neither_torch_nor_megatron():
    """megatron's writer (dist_checkpointing/strategies/filesystem_async.py,
    _get_write_results_queue) spawns a helper that imports the main module: with torch and
    megatron at train.py's top that cost ~2-4 s per run that checkpoints."""
    loaded = _modules_after(f"import runpy; runpy.run_path({str(REPO / 'train.py')!r}, "
                            "run_name='__mp_main__')")
    assert "hydra" in loaded and not loaded & {"torch", "megatron", "training", "compat"}


def test_a_config_refusal_comes_before_megatron_is_imported(tmp_path):
    """A bad value is refused by the checks that need neither megatron nor the process group
    (~2 s instead of ~6 on 2 cores), and nothing is written."""
    run_dir = tmp_path / "run"
    loaded = _modules_after(f"""
from hydra import compose, initialize_config_dir
from training.config import register_configs
from training.entry import run
register_configs()
with initialize_config_dir({str(REPO / 'recipes')!r}, version_base=None):
    raw = compose("train", overrides=["trainer=fast", "logger=disabled", "run.dir={run_dir}",
                                      "parallel.tensor=3"])
assert run(raw) == 2
""")
    assert "torch" in loaded and "megatron" not in loaded
    assert not run_dir.exists()


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

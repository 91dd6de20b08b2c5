"""train.py's start-up from the command line: a bad value is refused with one line (exit 2, or
Hydra's exit 1 for a choice outside its values) before anything is written, a layout the
preflight finds failing or an override pattern that matches no linear is refused the same way,
a good start-up logs the precision map and the preflight, what a process imports before it refuses,
or when megatron's checkpoint writer re-imports train.py in its spawned helper; after the
start-up a ValueError is a bug: exit 1 with its traceback; and tools.evaluate on a trained run
refuses TE's recipe changed by the environment as train.py does (the checks behind them, in-process:
tests/training/test_config_ranges.py, test_preflight.py, test_entry.py, test_overrides.py,
tests/test_errors.py, tests/tools/test_evaluate.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from train_helpers import FAST, REPO, patched_train_script, run_train

from errors import ExitCode


@pytest.mark.parametrize("overrides,key", [
    (["trainer.save_every=0"], "trainer.save_every"), (["trainer.lr=-1"], "trainer.lr"),
    (["precision=nvfp4", "precision.bf16_first_layers=20"], "precision.bf16_first_layers"),
], ids=["trainer.save_every", "trainer.lr", "precision.bf16_first_layers"])
def test_a_run_refused_for_a_bad_value_writes_nothing(tmp_path, data_cache, overrides, key):
    """Exit 2 with one line naming the key, and no run directory (not even an empty one)."""
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, *FAST, *overrides, cache_dir=data_cache, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {key}="), out
    assert "Traceback" not in out, out
    assert not run_dir.exists(), sorted(run_dir.rglob("*"))


def test_a_run_refused_for_a_choice_outside_its_values_writes_nothing(tmp_path):
    """Hydra refuses it while composing (exit 1), naming the key, the value and the choices."""
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, *FAST, "trainer.on_nan=sometimes", timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "Invalid value 'sometimes', expected one of [stop, skip]" in out, out
    assert "full_key: trainer.on_nan" in out and "Traceback" not in out, out
    assert not run_dir.exists(), sorted(run_dir.rglob("*"))


def test_start_up_refuses_a_failing_layout_before_writing(tmp_path, data_cache):
    """exit 2 from run()'s validation; run.dir is never created."""
    run_dir = tmp_path / "run"
    res = run_train(run_dir, *FAST, "precision=mxfp4", "model.ffn_hidden_size=1040",
                    "trainer.max_steps=1", cache_dir=data_cache, timeout=300)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    text = res.stdout + res.stderr
    assert "error: preflight: would fail on emulated: mlp.linear_fc1 Fprop (mxfp4)" in text
    assert "N (out_features) 1040 not a multiple of 32" in text
    assert "++precision.overrides={*.mlp.linear_fc1:bf16}" in text
    assert not run_dir.exists()


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


FAIL_IN_FIT = """
import training.trainer as trainer
def train_step(self, micro_batches, sink=None):
    if self.step == 1:
        raise ValueError("a bug at step 2")
    return real(self, micro_batches, sink)
real, trainer.Trainer.train_step = trainer.Trainer.train_step, train_step
"""


def test_a_value_error_inside_fit_is_a_bug_exit_1_with_its_traceback(tmp_path, data_cache):
    """Not exit 2 ("config error") without a traceback: after start-up a ValueError is a bug."""
    script = patched_train_script(tmp_path / "fail_in_fit.py", FAIL_IN_FIT)
    proc = run_train(tmp_path / "run", *FAST, "trainer.max_steps=3", cache_dir=data_cache,
                     script=script)
    out = proc.stdout + proc.stderr
    assert proc.returncode == ExitCode.BUG, out
    assert "Traceback" in out and "ValueError: a bug at step 2" in out
    assert "in train_step" in out  # the traceback reaches the raising frame


def test_start_up_refuses_an_override_pattern_matching_nothing_with_exit_2(tmp_path, data_cache):
    run_dir = tmp_path / "bad"
    res = run_train(run_dir, *FAST, "precision=nvfp4",
                    "++precision.overrides={*.mixer.inproj:bf16}", cache_dir=data_cache,
                    timeout=300)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    text = res.stdout + res.stderr
    assert "error: precision.overrides: '*.mixer.inproj' matches no linear" in text
    assert not run_dir.exists()


# trains a step
def test_start_up_prints_the_precision_map_and_the_preflight(tmp_path, data_cache):
    run_dir = tmp_path / "good"
    res = run_train(run_dir, *FAST, "precision=nvfp4_mamba_proj_bf16", "trainer.max_steps=1",
                    "++precision.overrides={layers.4.mlp.linear_fc1:fp8}", cache_dir=data_cache,
                    timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    log = (run_dir / "train.log").read_text()
    assert ("precision map (each linear's Fprop/Dgrad/Wgrad; runs of pattern layers that have the "
            "linear): mixer.in_proj: bf16 at 0-7 | mixer.out_proj: bf16 at 0-7 | mlp.linear_fc1: "
            "nvfp4 at 1,6; fp8 at 4; bf16 at 8 |") in log
    assert "preflight (emulated; tensor 1, 256 rows per GEMM): 24 low-precision GEMMs: 24 ok" in log


# reads the shared four-step run
def test_evaluate_on_te_refuses_a_recipe_changed_by_the_environment(shared_runs, parallel_context,
                                                                    monkeypatch):
    """tools.evaluate builds the same TE model: the same refusal, before any weight loads.
    The backend and the run's formats are stated (the shared run is BF16, on CPU)."""
    from errors import ConfigError
    from train_helpers import RESUMABLE
    from tools import evaluate

    run_dir, _ = shared_runs.get(*RESUMABLE)
    monkeypatch.setenv("NVTE_NVFP4_4OVER6", "all")
    monkeypatch.setattr("model.build.choose_backend", lambda *a, **k: ("te", "stated"))
    monkeypatch.setattr(evaluate, "te_formats", lambda precision: ["nvfp4"])  # load_model's name
    monkeypatch.setattr("model.build.build_model", lambda *a, **k: pytest.fail("built"))
    with pytest.raises(ConfigError, match="NVTE_NVFP4_4OVER6='all'"):
        evaluate.load_model(run_dir, None, parallel_context)

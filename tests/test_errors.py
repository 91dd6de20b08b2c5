"""One exit-code contract (errors.py): the enum is the README's table, no module defines codes of
its own, a foreseen refusal carries its code, anything else is a bug (exit 1, traceback), and
every code is produced by some test."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from errors import ConfigError, ExitCode, MissingError, ProjectError

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from train_helpers import FAST, patched_train_script, run_train  # noqa: E402


def product_files() -> list[Path]:
    skip = {"tests", ".venv", ".ci", "build", "runs"}
    return [p for p in sorted(REPO.rglob("*.py"))
            if not skip & set(p.relative_to(REPO).parts) and "egg-info" not in str(p)]


def test_the_readme_table_is_the_enum():
    text = (REPO / "README.md").read_text()
    table = text[text.index("### Exit codes"):text.index("## Precision recipes")]
    documented = {int(m) for m in re.findall(r"^\| (\d+) \|", table, re.MULTILINE)}
    assert documented == {int(code) for code in ExitCode}


def test_no_module_defines_exit_codes_of_its_own():
    """Only errors.py: no EXIT_* constants, no other ExitCode class, no exit-code numbers in the
    launchers but the one the Slurm script compares, which must equal the enum's."""
    found = []
    for path in product_files():
        if path.name == "errors.py" and path.parent == REPO:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name == "ExitCode":
                found.append(f"{path.relative_to(REPO)}: class ExitCode")
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name) and name.id.startswith("EXIT_"):
                        found.append(f"{path.relative_to(REPO)}:{node.lineno}: {name.id}")
    assert not found, found
    sbatch = (REPO / "launch" / "slurm.sbatch").read_text()
    assert int(re.search(r"^EXIT_PREEMPTED=(\d+)", sbatch, re.MULTILINE).group(1)) == \
        ExitCode.PREEMPTED


def test_project_errors_carry_their_codes():
    from data import prepare
    from data.config import DataConfigError, MissingDataError
    from data.indexed import OutputExists, PrefixInUse
    from model.hf import HFError
    from training.checkpoint import CheckpointMismatch, CheckpointNotWritten, NoUsableCheckpoint
    from training.metrics import WandbUnavailable
    from training.run_dir import RunDirBusy, UnsafeFile
    from training.safe_load import CheckpointRefused

    expected = {ConfigError("x"): ExitCode.CONFIG, MissingError("x"): ExitCode.MISSING,
                DataConfigError("x"): ExitCode.CONFIG, MissingDataError("x"): ExitCode.MISSING,
                HFError("x"): ExitCode.CONFIG, HFError("x", ExitCode.MISSING): ExitCode.MISSING,
                CheckpointMismatch("x"): ExitCode.CONFIG,
                CheckpointNotWritten("x"): ExitCode.UNWRITABLE,
                NoUsableCheckpoint("x"): ExitCode.NO_USABLE_CHECKPOINT,
                CheckpointRefused("x"): ExitCode.NO_USABLE_CHECKPOINT,
                WandbUnavailable("x"): ExitCode.WANDB_UNAVAILABLE,
                RunDirBusy("x"): ExitCode.IN_USE, UnsafeFile("/a", "is a link"): ExitCode.UNWRITABLE,
                prepare.UsageError("x"): ExitCode.CONFIG, prepare.StrictError("x"): ExitCode.BAD_INPUT,
                prepare.InputError("x"): ExitCode.BAD_INPUT,
                prepare.OutputError("x"): ExitCode.UNWRITABLE,
                PrefixInUse("x"): ExitCode.IN_USE, OutputExists("x"): ExitCode.CONFIG}
    for error, code in expected.items():
        assert isinstance(error, ProjectError) and error.code is code, (type(error), error.code)
    # Config errors stay ValueErrors (Python's convention for a bad value).
    assert isinstance(MissingDataError("x"), ValueError) and isinstance(HFError("x"), ValueError)


def test_a_missing_init_from_directory_exits_3(tmp_path, demo_corpus):
    from hydra import compose, initialize_config_dir

    from training import entry
    from training.config import register_configs

    register_configs()
    with initialize_config_dir(str(REPO / "recipes"), version_base=None):
        raw = compose("train", overrides=[*FAST, f"run.dir={tmp_path / 'run'}",
                                          f"data.cache_dir={demo_corpus[0]}",
                                          f"model.init_from={tmp_path / 'no_such_dir'}"])
    assert entry.run(raw) == ExitCode.MISSING
    assert not (tmp_path / "run").exists()


def test_a_value_error_outside_the_config_checks_of_the_start_up_is_a_bug(
        tmp_path, demo_corpus, monkeypatch):
    """Only the calls that check the config turn a ValueError into exit 2: one raised by the
    preflight's own code (a bug there) keeps its traceback instead of reading as a bad value."""
    from hydra import compose, initialize_config_dir

    from training import entry
    from training.config import register_configs

    def broken_preflight(*args, **kwargs):
        raise ValueError("a bug in the preflight")

    monkeypatch.setattr("training.preflight.run_preflight", broken_preflight)
    register_configs()
    with initialize_config_dir(str(REPO / "recipes"), version_base=None):
        raw = compose("train", overrides=[*FAST, f"run.dir={tmp_path / 'run'}",
                                          f"data.cache_dir={demo_corpus[0]}"])
        bad = compose("train", overrides=[*FAST, f"run.dir={tmp_path / 'run'}",
                                          f"data.cache_dir={demo_corpus[0]}",
                                          "precision.switch_to_bf16.at_fraction=1.5"])
    with pytest.raises(ValueError, match="a bug in the preflight"):
        entry.run(raw)
    assert entry.run(bad) == ExitCode.CONFIG  # a bad value is still exit 2
    assert not (tmp_path / "run").exists()


FAIL_IN_FIT = """
import training.trainer as trainer
def train_step(self, micro_batches, sink=None):
    if self.step == 1:
        raise ValueError("a bug at step 2")
    return real(self, micro_batches, sink)
real, trainer.Trainer.train_step = trainer.Trainer.train_step, train_step
"""


@pytest.mark.slow
def test_a_value_error_inside_fit_is_a_bug_exit_1_with_its_traceback(tmp_path, data_cache):
    """Not exit 2 ("config error") without a traceback: after start-up a ValueError is a bug."""
    script = patched_train_script(tmp_path / "fail_in_fit.py", FAIL_IN_FIT)
    proc = run_train(tmp_path / "run", *FAST, "trainer.max_steps=3", cache_dir=data_cache,
                     script=script)
    out = proc.stdout + proc.stderr
    assert proc.returncode == ExitCode.BUG, out
    assert "Traceback" in out and "ValueError: a bug at step 2" in out
    assert "in train_step" in out  # the traceback reaches the raising frame


def test_every_exit_code_is_produced_by_a_test():
    """Each code is asserted by name (ExitCode.X) or number (`returncode == N`, `rc == N`, ...)
    in some test file other than this one."""
    text = "\n".join(p.read_text() for p in sorted((REPO / "tests").rglob("test_*.py"))
                     if p.name != "test_errors.py")
    missing = [code.name for code in ExitCode
               if f"ExitCode.{code.name}" not in text
               and not re.search(rf"(returncode|rc|code|\)) == {int(code)}\b", text)]
    # BUG (1) is produced here, by the ValueError-in-fit test above.
    assert set(missing) <= {"BUG"}, missing

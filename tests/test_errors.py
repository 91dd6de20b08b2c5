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

from train_helpers import FAST  # noqa: E402


def product_files() -> list[Path]:
    skip = {"tests", ".venv", ".ci", "build", "runs"}
    return [p for p in sorted(REPO.rglob("*.py"))
            if not skip & set(p.relative_to(REPO).parts) and "egg-info" not in str(p)]


def test_the_readme_table_is_the_enum():
    text = (REPO / "README.md").read_text()
    table = text[text.index("### Exit codes"):text.index("## Precision recipes")]
    documented = {int(m) for m in re.findall(r"^\| (\d+) \|", table, re.MULTILINE)}
    assert documented == {int(code) for code in ExitCode}


def _int_literal(node) -> bool:
    """An int written as a number (`0`, `2`, `0 if ok else 1`), not a name (ExitCode.OK)."""
    if isinstance(node, ast.IfExp):
        return _int_literal(node.body) or _int_literal(node.orelse)
    return (isinstance(node, ast.Constant) and isinstance(node.value, int)
            and not isinstance(node.value, bool))


def _returns_of(function: ast.FunctionDef):
    """The return statements of `function` itself, not of functions defined inside it."""
    stack = list(function.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Return):
            yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))


def exit_code_leaks(path: Path) -> list[str]:
    """Where a module defines or returns exit codes of its own: a class ExitCode, a module-level
    name with EXIT in it bound to a number, a `main` returning a number."""
    where, tree = path.relative_to(REPO) if path.is_relative_to(REPO) else path, None
    tree = ast.parse(path.read_text())
    found = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and _int_literal(node.value):
            found += [f"{where}:{node.lineno}: {t.id} = {ast.unparse(node.value)}"
                      for t in node.targets if isinstance(t, ast.Name) and "EXIT" in t.id.upper()]
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "ExitCode":
            found.append(f"{where}: class ExitCode")
        if isinstance(node, ast.FunctionDef) and node.name == "main":
            found += [f"{where}:{r.lineno}: main returns {ast.unparse(r.value)}"
                      for r in _returns_of(node) if r.value is not None and _int_literal(r.value)]
    return found


def test_no_module_defines_exit_codes_of_its_own():
    """Only errors.py: no module-level EXIT constant (SKIP_EXIT = 77 was one), no other ExitCode
    class, no `main` returning a bare number; each launcher's EXIT_<NAME>=<n> is the enum's, and
    it exits with no other number but 0 and 1 (a bug)."""
    found = []
    for path in product_files():
        if path.name == "errors.py" and path.parent == REPO:
            continue
        found += exit_code_leaks(path)
    assert not found, found
    for script in sorted((REPO / "launch").glob("*.sh")) + sorted((REPO / "launch").glob("*.sbatch")):
        text = "\n".join(line for line in script.read_text().splitlines()
                         if not line.lstrip().startswith("#"))  # comments may say "exit 75"
        for name, value in re.findall(r"^EXIT_(\w+)=(\d+)", text, re.MULTILINE):
            assert ExitCode[name] == int(value), (script.name, name, value)
        bare = [n for n in re.findall(r"\bexit (\d+)", text) if n not in ("0", "1")]
        assert not bare, (script.name, bare)


def test_the_exit_code_guard_finds_what_it_must(tmp_path):
    module = tmp_path / "tool.py"
    module.write_text("SKIP_EXIT = 77\nMAX_EXITS = 3\nOK = 0\n"
                      "def main():\n"
                      "    def helper():\n"
                      "        return 5\n"
                      "    if helper():\n"
                      "        return 0 if True else 1\n"
                      "    return ExitCode.OK\n")
    assert exit_code_leaks(module) == [f"{module}:1: SKIP_EXIT = 77", f"{module}:2: MAX_EXITS = 3",
                                       f"{module}:8: main returns 0 if True else 1"]


def test_project_errors_carry_their_codes():
    from data import prepare
    from data.config import DataConfigError, MissingDataError
    from data.indexed import OutputExists, PrefixInUse
    from model.hf import HFError
    from training.checkpoint import CheckpointMismatch, CheckpointNotWritten, NoUsableCheckpoint
    from training.metrics import WandbUnavailable
    from training.run_dir import RunDirBusy, UnsafeFile
    from training.run_reader import RunDirError
    from training.safe_load import CheckpointRefused

    expected = {ConfigError("x"): ExitCode.CONFIG, MissingError("x"): ExitCode.MISSING,
                DataConfigError("x"): ExitCode.CONFIG, MissingDataError("x"): ExitCode.MISSING,
                HFError("x"): ExitCode.CONFIG, HFError("x", ExitCode.MISSING): ExitCode.MISSING,
                CheckpointMismatch("x"): ExitCode.CONFIG,
                CheckpointNotWritten("x"): ExitCode.UNWRITABLE,
                NoUsableCheckpoint("x"): ExitCode.NO_USABLE_CHECKPOINT,
                RunDirError("x"): ExitCode.CONFIG,
                RunDirError("x", ExitCode.NO_USABLE_CHECKPOINT): ExitCode.NO_USABLE_CHECKPOINT,
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

    monkeypatch.setattr("training.entry.run_preflight", broken_preflight)  # where _start_up looks it up
    register_configs()
    with initialize_config_dir(str(REPO / "recipes"), version_base=None):
        raw = compose("train", overrides=[*FAST, f"run.dir={tmp_path / 'run'}",
                                          f"data.cache_dir={demo_corpus[0]}"])
        bad = compose("train", overrides=[*FAST, f"run.dir={tmp_path / 'run'}",
                                          f"data.cache_dir={demo_corpus[0]}",
                                          "precision.switch_to_bf16.at_fraction=1.5"])
    from training.distributed import group_joined

    assert not group_joined()
    with pytest.raises(ValueError, match="a bug in the preflight"):
        entry.run(raw)
    # refused after joining the process group: the group is left all the same, so the next start
    # in this process reads the launched world size from the environment, not a stale group
    assert not group_joined()
    assert entry.run(bad) == ExitCode.CONFIG  # a bad value is still exit 2
    assert not (tmp_path / "run").exists()


def test_every_exit_code_is_produced_by_a_test():
    """Each code is asserted by name (ExitCode.X) or number (`returncode == N`, `rc == N`, ...)
    in some test file other than this one."""
    text = "\n".join(p.read_text() for p in sorted((REPO / "tests").rglob("test_*.py"))
                     if p.name != "test_errors.py")
    missing = [code.name for code in ExitCode
               if f"ExitCode.{code.name}" not in text
               and not re.search(rf"(returncode|rc|code|\)) == {int(code)}\b", text)]
    # BUG (1) too: tests/system/test_start_up.py's ValueError inside fit.
    assert not missing, missing

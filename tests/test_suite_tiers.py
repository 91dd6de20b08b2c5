"""The suite's two tiers, by directory. tests/system holds every test that starts processes
(train.py, torchrun, a module's command line, ranks spawned over gloo) or trains a run of several
steps, and its conftest marks each of them `slow`; everything else is the unit tier, which
`make test-fast` runs. So the unit tier stays fast only if no test outside tests/system is
marked slow (the marker would hide it from `-m "not slow"` alone) and none starts a process of
the project: these checks read the test files' source.

A stand-in process that imports only the standard library (`python -c pass` for a pid that is
dead, a fake command printing what a script would) is no process of the project and may stay."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
SYSTEM = TESTS / "system"

# What starts train.py or ranks: the shared helpers (train_helpers.py), the session's shared runs,
# torch.multiprocessing's spawn, torch's launcher.
STARTERS = {"run_train", "popen_train", "spawn", "start_processes"}
LAUNCHERS = {"torch.distributed.run", "torchrun"}


def unit_tier_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if SYSTEM not in p.parents)


def slow_marks(tree: ast.AST) -> list[int]:
    """Lines of `pytest.mark.slow` (or `mark.slow`): a decorator, `pytestmark`, `pytest.param`'s marks."""
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr == "slow"
            and ((isinstance(node.value, ast.Attribute) and node.value.attr == "mark")
                 or (isinstance(node.value, ast.Name) and node.value.id == "mark"))]


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _is_interpreter(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "executable"
            and isinstance(node.value, ast.Name) and node.value.id == "sys")


def _string_values(tree: ast.AST, name: str) -> list[str] | None:
    """The string constants assigned to `name` in the module (None if any assignment is not one)."""
    values = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(_name(t) == name for t in node.targets):
            if not (isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
                return None
            values.append(node.value.value)
    return values or None


def _imports_beyond_the_standard_library(code: str) -> list[str]:
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return ["(code that does not parse)"]
    names = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    names += [node.module or "." for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    return [n for n in names if n.split(".")[0] not in sys.stdlib_module_names]


def _command_problem(tree: ast.AST, argv: list[ast.AST]) -> str | None:
    """Why an argv starting with sys.executable starts a process of the project, or None."""
    if len(argv) >= 3 and isinstance(argv[1], ast.Constant) and argv[1].value == "-c":
        code = argv[2]
        if isinstance(code, ast.Constant) and isinstance(code.value, str):
            sources = [code.value]
        else:
            sources = _string_values(tree, _name(code)) if _name(code) else None
        if sources is None:
            return "an interpreter running code that is not a string literal"
        beyond = sorted({n for s in sources for n in _imports_beyond_the_standard_library(s)})
        return f"an interpreter importing {', '.join(beyond)}" if beyond else None
    if len(argv) >= 2 and isinstance(argv[1], ast.Constant) and argv[1].value == "-m":
        return "an interpreter running a module"
    return "an interpreter running a script"


def process_starts(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) of each place a test module starts a process of the project."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _name(node.func) in STARTERS:
            found.append((node.lineno, f"{_name(node.func)}()"))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if "shared_runs" in [a.arg for a in node.args.args]:
                found.append((node.lineno, "the shared_runs fixture (train.py runs)"))
        if isinstance(node, ast.Constant) and node.value in LAUNCHERS:
            found.append((node.lineno, repr(node.value)))
        sequences = []
        if isinstance(node, (ast.List, ast.Tuple)):
            sequences.append(node.elts)
        if isinstance(node, ast.Call):
            sequences.append(node.args)
        for argv in sequences:
            if argv and _is_interpreter(argv[0]):
                problem = _command_problem(tree, argv)
                if problem:
                    found.append((argv[0].lineno, problem))
    return sorted(set(found))


def test_no_test_outside_the_system_tier_is_marked_slow():
    marked = [f"{path.relative_to(REPO)}:{line}" for path in unit_tier_files()
              for line in slow_marks(ast.parse(path.read_text()))]
    assert not marked, ("a slow test belongs in tests/system, whose conftest marks it:\n"
                        + "\n".join(marked))


def test_no_unit_test_starts_a_process_of_the_project():
    modules = [p for p in unit_tier_files() if p != Path(__file__).resolve()
               and (p.name.startswith("test_") or (p.name == "conftest.py" and p.parent != TESTS))]
    assert len(modules) > 50, f"only {len(modules)} unit-tier test modules found"
    starts = [f"{path.relative_to(REPO)}:{line}: {what}" for path in modules
              for line, what in process_starts(ast.parse(path.read_text()))]
    assert not starts, "a test that starts a process belongs in tests/system:\n" + "\n".join(starts)


def test_the_checks_find_what_they_must():
    caught = {
        "@pytest.mark.slow\ndef test_x():\n    pass\n": "marker",
        "pytestmark = pytest.mark.slow\n": "marker",
        "from pytest import mark\n@mark.slow\ndef test_x():\n    pass\n": "marker",
        "def test_x(tmp_path):\n    run_train(tmp_path, 'trainer=fast')\n": "run_train()",
        "def test_x(tmp_path):\n    th.popen_train(tmp_path, tmp_path)\n": "popen_train()",
        "def test_x(shared_runs):\n    pass\n": "shared_runs",
        "def test_x():\n    mp.spawn(work, nprocs=2)\n": "spawn()",
        "def test_x():\n    subprocess.run([sys.executable, '-m', 'tools.evaluate'])\n": "a module",
        "def test_x():\n    subprocess.run([sys.executable, str(REPO / 'train.py')])\n": "a script",
        "def test_x():\n    launcher = [sys.executable]\n": "a script",
        "def test_x():\n    subprocess.run([sys.executable, '-c', 'import torch'])\n": "importing torch",
        "def test_x():\n    code = 'from training import entry'\n"
        "    subprocess.run([sys.executable, '-c', code])\n": "importing training",
        "def test_x():\n    subprocess.run([sys.executable, '-c', f'import {m}'])\n": "not a string",
        "def test_x():\n    subprocess.run(['torchrun', 'train.py'])\n": "'torchrun'",
        "def test_x():\n    cmd = ['-m', 'torch.distributed.run']\n": "'torch.distributed.run'",
    }
    for source, what in caught.items():
        tree = ast.parse(source)
        found = [f"line {line}" for line in slow_marks(tree)] if what == "marker" else [
            w for _, w in process_starts(tree)]
        assert found and (what == "marker" or any(what in w for w in found)), (source, found)
    allowed = [
        "def test_x():\n    subprocess.Popen([sys.executable, '-c', 'pass']).wait()\n",
        "def test_x():\n    fake = ('import json, sys\\n' 'print(sys.argv)')\n"
        "    resume_demo([sys.executable, '-c', fake, 'x'])\n",
        "def test_x():\n    subprocess.run(['bash', '-n', 'launch/slurm.sbatch'])\n",
        "@pytest.mark.gpu\ndef test_x(make_trainer):\n    make_trainer().train_step(None)\n",
    ]
    for source in allowed:
        tree = ast.parse(source)
        assert not slow_marks(tree) and not process_starts(tree), source


def test_the_system_tier_marks_each_of_its_tests_slow_and_runs_them_last():
    spec = importlib.util.spec_from_file_location("system_tier_conftest", SYSTEM / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)

    def item(path: Path):
        marks = []
        return SimpleNamespace(path=path, marks=marks, add_marker=marks.append)

    first, second = item(SYSTEM / "test_train_e2e.py"), item(SYSTEM / "test_faults.py")
    unit = [item(TESTS / "training" / "test_plan.py"), item(TESTS / "test_docs.py")]
    items = [first, unit[0], second, unit[1]]
    conftest.pytest_collection_modifyitems(None, items)
    assert items == [*unit, first, second]
    assert [m.name for m in first.marks + second.marks] == ["slow", "slow"]
    assert unit[0].marks == unit[1].marks == []


def test_make_test_fast_runs_the_unit_tier_and_make_test_both():
    recipes, target = {}, None
    for line in (REPO / "Makefile").read_text().splitlines():
        if line and not line.startswith(("\t", " ", "#")) and ":" in line and "=" not in line.split(":")[0]:
            target = line.split(":")[0]
        elif line.startswith("\t") and target:
            recipes.setdefault(target, []).append(line.strip())
    assert any("--ignore=tests/system" in r for r in recipes["test-fast"]), recipes["test-fast"]
    assert not any("tests/system" in r or "slow" in r for r in recipes["test"]), recipes["test"]


def test_the_tier_times_split_the_reports_by_directory():
    spec = importlib.util.spec_from_file_location("root_conftest", TESTS / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    reports = [SimpleNamespace(nodeid="tests/system/test_faults.py::test_x", duration=3.0),
               SimpleNamespace(nodeid="tests/training/test_plan.py::test_y", duration=1.5),
               SimpleNamespace(nodeid="tests/test_docs.py::test_z", duration=0.5),
               SimpleNamespace(nodeid="tests/system/test_reshard.py::test_w", duration=2.0)]
    assert conftest.tier_seconds(reports) == {"unit": 2.0, "system": 5.0}

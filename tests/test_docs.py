"""Docs that cannot drift from the code: every test the docs cite exists, and every exit code a
fault table gives is one of `ExitCode`'s and is the code its cited tests assert."""

from __future__ import annotations

import ast
import builtins
import importlib
import re
from functools import lru_cache
from pathlib import Path

from errors import ExitCode, ProjectError

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])

# `test_x.py::test_name`, and `::test_other` after it, which cites the same file
CITATION = re.compile(r"(?:([\w/]*test_\w*\.py)|(?<=[\s,`(]))::(test_\w+)")


@lru_cache(maxsize=None)
def _test_file(name: str) -> Path:
    found = [p for p in (REPO / "tests").rglob(Path(name).name)
             if str(p.relative_to(REPO)).endswith(name)]
    assert len(found) == 1, f"{name}: {len(found)} test files of that name"
    return found[0]


@lru_cache(maxsize=None)
def _functions(path: Path) -> dict[str, str]:
    """{test function name: its source, decorators (parametrize) included} of a test file."""
    text, lines = path.read_text(), path.read_text().splitlines()
    return {node.name: "\n".join(lines[min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1:
                                       node.end_lineno])
            for node in ast.walk(ast.parse(text)) if isinstance(node, ast.FunctionDef)}


def _citations(text: str) -> list[tuple[str, str]]:
    """(file name, test name) of every citation in `text`, in order."""
    cited, current = [], None
    for match in CITATION.finditer(text):
        current = match.group(1) or current
        if current is not None:
            cited.append((current, match.group(2)))
    return cited


def test_every_cited_test_exists():
    missing = []
    for doc in DOCS:
        for line_no, line in enumerate(doc.read_text().splitlines(), 1):
            for file_name, test in _citations(line):
                if test not in _functions(_test_file(file_name)):
                    missing.append(f"{doc.relative_to(REPO)}:{line_no}: {file_name}::{test}")
    assert not missing, "\n".join(missing)


def _fault_rows(doc: Path):
    """(line number, exit codes, cited tests) of each row of a table with `exit` and `test` columns."""
    columns = None
    for line_no, line in enumerate(doc.read_text().splitlines(), 1):
        if not line.startswith("|"):
            columns = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if columns is None:
            columns = {name: i for i, name in enumerate(cells)}
            if not {"exit", "test"} <= columns.keys():
                columns = {}
            continue
        if not columns or set(line) <= set("|-: "):
            continue
        codes = [int(c) for c in re.findall(r"\b\d+\b", cells[columns["exit"]])]
        yield line_no, codes, _citations(cells[columns["test"]])


@lru_cache(maxsize=None)
def _error_codes() -> dict[str, int]:
    """{exception class name: the exit code it ends a command with}: each `ProjectError` subclass
    of the product (found by name through the product's sources, then imported for its `.code`);
    a ValueError is a bad value (exit 2, the start-up's handler); any other builtin, a bug (1)."""
    from test_errors import product_files

    bases, homes = {}, {}
    for path in product_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = {b.id for b in node.bases if isinstance(b, ast.Name)}
                homes[node.name] = ".".join(path.relative_to(REPO).with_suffix("").parts)
    derived, grew = {"ProjectError"}, True
    while grew:
        new = {name for name, parents in bases.items() if parents & derived} - derived
        derived, grew = derived | new, bool(new)
    codes = {name: int(getattr(importlib.import_module(homes[name]), name).code)
             for name in derived}
    codes.update({name: int(ExitCode.BUG) for name in dir(builtins)
                  if isinstance(getattr(builtins, name), type)
                  and issubclass(getattr(builtins, name), BaseException)})
    codes["ValueError"] = int(ExitCode.CONFIG)
    return codes


def _asserts_code(source: str, code: int) -> bool:
    """Whether a test's source asserts `code`: `ExitCode.<NAME>`, the number compared or said
    ("== 7", "exit 7"), or `pytest.raises(E)` of an error whose code it is."""
    raised = [name.rpartition(".")[2] for name in re.findall(r"pytest\.raises\(\(?([\w.]+)", source)]
    return (f"ExitCode.{ExitCode(code).name}" in source
            or re.search(rf"(?:==|!=|exit|exits|in \(|,) *{code}(?![\w.])", source) is not None
            or any(_error_codes().get(name) == code for name in raised))


def test_every_exit_code_in_a_fault_table_is_the_enums_and_its_tests_assert_it():
    """A row that gives exit 1 where the code exits 7 is caught: none of its tests names 1."""
    valid, wrong = {int(c) for c in ExitCode}, []
    rows = 0
    for doc in DOCS:
        for line_no, codes, cited in _fault_rows(doc):
            rows += 1
            where = f"{doc.relative_to(REPO)}:{line_no}"
            wrong += [f"{where}: exit {c} is not an ExitCode" for c in codes if c not in valid]
            sources = [_functions(_test_file(f)).get(t, "") for f, t in cited]
            wrong += [f"{where}: exit {c} ({ExitCode(c).name}), but no cited test names it"
                      for c in codes if c in valid and c != ExitCode.OK and cited
                      and not any(_asserts_code(s, c) for s in sources)]
    assert rows > 50, f"only {rows} fault-table rows found: has the tables' format changed?"
    assert not wrong, "\n".join(wrong)


def test_the_citation_reader_follows_continuations_and_the_code_check_tells_numbers_apart():
    line = "a `test_run_dir.py::test_a`, `::test_b` and `x/test_c.py::test_d`"
    assert _citations(line) == [("test_run_dir.py", "test_a"), ("test_run_dir.py", "test_b"),
                                ("x/test_c.py", "test_d")]
    assert _asserts_code("assert rc == ExitCode.BAD_INPUT", 7)
    assert _asserts_code("assert proc.returncode == 7, proc.stderr", 7)
    assert not _asserts_code("assert rc == 17 and x[7.5]", 7)
    assert not _asserts_code("assert rc == ExitCode.UNWRITABLE", 7)
    assert _asserts_code("with pytest.raises(CheckpointRefused, match=x):", 6)
    assert not _asserts_code("with pytest.raises(CheckpointRefused, match=x):", 2)
    assert _asserts_code("with pytest.raises(FileNotFoundError):", 1)
    assert _asserts_code("with pytest.raises(hf.HFError, match=x):", 2)


def test_product_code_gives_reasons_not_tracker_numbers():
    """A tracker issue's number tells a maintainer nothing: the tracker is not in the repository.
    Product code and the tests say the reason, or the behaviour a test guards, instead (docs and
    commit messages may cite issues)."""
    from test_errors import product_files

    files = product_files() + sorted((REPO / "tests").rglob("*.py"))
    cited = [f"{path.relative_to(REPO)}:{n}: {line.strip()}" for path in files
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"\bissues? \d+", line, re.IGNORECASE)]
    assert not cited, "\n".join(cited)

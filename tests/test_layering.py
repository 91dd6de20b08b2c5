"""The top-level packages form layers: each imports only the layers below it, so no import cycle
can form among them.

    errors, compat, nvfp4_recipe,   import none of the project's other packages
    atomic_files
    field_ranges                    <- errors
    data                            <- errors, field_ranges, atomic_files
    model                           <- errors, field_ranges, compat, nvfp4_recipe
    training                        <- model, data and everything below them
    tools, launch, benchmarks       <- training and everything below it
    studies                         <- benchmarks and everything below it

`tools` holds the offline commands over finished runs (the Hugging Face export, evaluate); what
the training loop also uses (the run reader, the lm-eval model, the task preparation) stays in
`training`, so no arrow runs up from training to tools. Nothing imports tools.

Every import statement of every module counts, also those inside functions: a deferred import
still makes the importing package depend on the imported one.

Inside a package the modules form no circle either (`from .config import X`, `from model import
hf`, `import model.hf` alike; a package's `__init__` is a module like the others).

`errors` (the exit codes) sits under every package but `nvfp4_recipe` and `compat`: the recipe
ships alone in the wheel, and its refusals are plain ValueErrors that the config layer turns
into `errors.ConfigError`.
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

_FLOOR = {"errors", "compat", "nvfp4_recipe", "field_ranges", "atomic_files"}
BELOW = {
    "errors": set(),
    "compat": set(),
    "nvfp4_recipe": set(),
    "atomic_files": set(),  # whole-or-nothing writes and dead writers' temporaries
    "field_ranges": {"errors"},  # the config schemas' declared ranges (nvfp4_recipe's wheel lacks it)
    "data": {"errors", "field_ranges", "atomic_files"},
    "model": _FLOOR,
    "training": _FLOOR | {"model", "data"},
    "tools": _FLOOR | {"training", "model", "data"},  # commands over finished runs
    "launch": _FLOOR | {"training", "model", "data"},
    "benchmarks": _FLOOR | {"training", "model", "data"},
    "studies": _FLOOR | {"benchmarks", "training", "model", "data"},
}
# Modules allowed to reach up a layer, with the reason; none today (a run's checkpoint is read by
# training/run_reader.py for the export in tools/hf_export.py; model/hf.py only maps the weights).
EXCEPTIONS: set[tuple[str, str]] = set()


def package_files(package: str) -> list[Path]:
    path = REPO / package
    return sorted(path.rglob("*.py")) if path.is_dir() else [REPO / f"{package}.py"]


def imported_packages(file: Path) -> set[str]:
    """The project's top-level packages that `file` imports (relative imports stay inside)."""
    found = set()
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module]
        else:
            continue
        found.update(name.split(".")[0] for name in names if name.split(".")[0] in BELOW)
    return found


def import_edges() -> dict[tuple[str, str], list[str]]:
    """(importer, imported) package pairs -> the importing files, relative to the repository."""
    edges: dict[tuple[str, str], list[str]] = {}
    for package in BELOW:
        for file in package_files(package):
            for imported in imported_packages(file) - {package}:
                edges.setdefault((package, imported), []).append(str(file.relative_to(REPO)))
    return edges


def test_every_package_is_on_disk():
    for package in BELOW:
        assert package_files(package) and all(f.is_file() for f in package_files(package)), package


def test_each_package_imports_only_the_layers_below_it():
    upward = {(file, imported): importer
              for (importer, imported), files in import_edges().items()
              if imported not in BELOW[importer] for file in files}
    unexpected = sorted(f"{file} ({importer}) imports {imported}"
                        for (file, imported), importer in upward.items()
                        if (file, imported) not in EXCEPTIONS)
    assert not unexpected, "imports against the layering:\n" + "\n".join(unexpected)
    stale = EXCEPTIONS - set(upward)
    assert not stale, f"no longer imported, remove from EXCEPTIONS: {sorted(stale)}"


def test_the_package_graph_is_acyclic_apart_from_the_exceptions():
    graph: dict[str, set[str]] = {package: set() for package in BELOW}
    for (importer, imported), files in import_edges().items():
        if any((file, imported) not in EXCEPTIONS for file in files):
            graph[importer].add(imported)
    done: set[str] = set()

    def visit(package: str, path: list[str]) -> None:
        assert package not in path, "import cycle: " + " -> ".join([*path, package])
        if package not in done:
            for imported in sorted(graph[package]):
                visit(imported, [*path, package])
            done.add(package)

    for package in BELOW:
        visit(package, [])


# Module edges inside a package that still close a circle, with the reason; each is a debt.
MODULE_CYCLE_EXCEPTIONS: dict[tuple[str, str], str] = {}


def module_name(file: Path) -> str:
    parts = list(file.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(file: Path, modules: set[str]) -> set[str]:
    """The modules among `modules` that `file` imports: an imported name resolves to the longest
    module it names (`from model import hf` -> model.hf; `from model import build_model` ->
    model), relative imports against the file's own package."""
    name = module_name(file)
    package = name.split(".") if file.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            candidates = [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        for candidate in candidates:
            parts = candidate.split(".")
            while parts and ".".join(parts) not in modules:
                parts.pop()
            if parts:
                found.add(".".join(parts))
    return found - {name}


def module_graph(package: str) -> dict[str, set[str]]:
    files = package_files(package)
    modules = {module_name(f) for f in files}
    return {module_name(f): imported_modules(f, modules) for f in files}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One circle of `graph` as [a, b, ..., a], or [] when there is none."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str]:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return []
        for target in sorted(graph.get(node, ())):
            cycle = visit(target, [*path, node])
            if cycle:
                return cycle
        done.add(node)
        return []

    for node in sorted(graph):
        cycle = visit(node, [])
        if cycle:
            return cycle
    return []


@pytest.mark.parametrize("package", [p for p in BELOW if (REPO / p).is_dir()])
def test_the_modules_of_a_package_form_no_circle(package):
    graph = module_graph(package)
    for importer, imported in MODULE_CYCLE_EXCEPTIONS:
        if importer in graph:
            assert imported in graph[importer], f"stale: remove {importer} -> {imported}"
            graph[importer] = graph[importer] - {imported}
    cycle = find_cycle(graph)
    assert not cycle, f"import circle in {package}: " + " -> ".join(cycle)


def test_the_module_walker_resolves_relative_package_and_deferred_imports(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("def f():\n    from pkg import b\n")
    (pkg / "b.py").write_text("from .sub.c import g\nimport pkg.sub\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from .. import a\nfrom ..b import x\nimport os\n")
    graph = module_graph("pkg")
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.sub.c", "pkg.sub"},
                     "pkg.sub": set(), "pkg.sub.c": {"pkg.a", "pkg.b"}}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]
    assert find_cycle({"x": {"y"}, "y": set()}) == []


def test_the_walker_sees_deferred_and_aliased_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import compat as c\n"
                      "def f():\n    from training.plan import build_plan\n"
                      "    import model.build\n"
                      "from . import sibling\nimport numpy\n")
    assert imported_packages(module) == {"compat", "training", "model"}


# -- deferred imports say why ---------------------------------------------------------------------
# A project import inside a function hides a dependency from the module's top. Where one must stay
# there (megatron's ~3 s kept out of a refused start, a package a machine may lack, a spawned
# process that re-imports the module), a comment on its line or the line above says why; a comment
# above a run of consecutive imports covers the run. A bare `# noqa: ...` is no reason.


def _comments(source: str) -> dict[int, str]:
    """{line: the comment's text, lint directives removed} of every comment that says something."""
    found = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            text = re.sub(r"noqa(:\s*[A-Z]+[0-9]+(,\s*[A-Z]+[0-9]+)*)?|type:\s*ignore\S*", "",
                          token.string.lstrip("#")).strip()
            if text:
                found[token.start[0]] = text
    return found


def _is_project_import(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        return any(alias.name.split(".")[0] in BELOW for alias in node.names)
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] in BELOW
    return False


def unexplained_deferred_imports(file: Path) -> list[int]:
    """The lines of the project imports inside functions of `file` that no comment explains."""
    source = file.read_text()
    comments = _comments(source)
    found = []

    def explained(node: ast.AST, previous: ast.AST | None, ok: set[int]) -> bool:
        lines = range(node.lineno - 1, node.end_lineno + 1)  # the line above and its own
        return (any(line in comments for line in lines)
                or (previous is not None and id(previous) in ok
                    and previous.end_lineno == node.lineno - 1))

    def visit(node: ast.AST, in_function: bool) -> None:
        ok: set[int] = set()
        previous = None
        for child in ast.iter_child_nodes(node):
            if in_function and _is_project_import(child):
                if explained(child, previous, ok):
                    ok.add(id(child))
                else:
                    found.append(child.lineno)
            previous = child if isinstance(child, (ast.Import, ast.ImportFrom)) else None
            visit(child, in_function or isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(source, str(file)), False)
    return sorted(found)


def test_every_deferred_project_import_says_why():
    files = [f for package in BELOW for f in package_files(package)] + [REPO / "train.py"]
    unexplained = [f"{file.relative_to(REPO)}:{line}"
                   for file in files for line in unexplained_deferred_imports(file)]
    assert not unexplained, (
        "project imports inside functions without a comment saying why they are not at the "
        "module's top (move them up, or say why on the line or the line above):\n"
        + "\n".join(unexplained))


def test_the_deferred_import_check_finds_an_unexplained_one(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "import model.build\n"                                    # 1 top: fine
        "def f():\n"                                              # 2
        "    import os\n"                                         # 3 not the project's
        "    from training.plan import build_plan\n"              # 4 unexplained
        "    from . import sibling  # noqa: F401\n"               # 5 a directive only
        "    # deferred: megatron\n"                              # 6
        "    from model.build import build_model\n"               # 7 explained
        "    from training.config import TrainerConfig\n"         # 8 the run above covers it
        "\n"                                                      # 9
        "    from data import build_data\n"                       # 10 the run ended
        "    x = lambda: __import__('os')\n"                      # 11
        "    if x:\n"                                             # 12
        "        from errors import ExitCode  # deferred: a cycle\n"  # 13 explained
        "        import compat\n"                                 # 14 covered
        "class C:\n"                                              # 15
        "    from model import hf\n"                              # 16 a class body: at import
        "    def g(self):\n"                                      # 17
        "        from ..model import hf\n")                       # 18 relative: unexplained
    assert unexplained_deferred_imports(module) == [4, 5, 10, 18]

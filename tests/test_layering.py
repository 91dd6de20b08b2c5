"""The top-level packages form layers: each imports only the layers below it, so no import cycle
can form among them.

    errors, compat, nvfp4_recipe    import none of the project's other packages
    field_ranges                    <- errors
    data                            <- errors, field_ranges
    model                           <- errors, field_ranges, compat, nvfp4_recipe
    training                        <- model, data and everything below them
    launch, benchmarks              <- training and everything below it
    studies                         <- benchmarks and everything below it

Every import statement of every module counts, also those inside functions: a deferred import
still makes the importing package depend on the imported one.

`errors` (the exit codes) sits under every package but `nvfp4_recipe` and `compat`: the recipe
ships alone in the wheel, and its refusals are plain ValueErrors that the config layer turns
into `errors.ConfigError`.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_FLOOR = {"errors", "compat", "nvfp4_recipe", "field_ranges"}
BELOW = {
    "errors": set(),
    "compat": set(),
    "nvfp4_recipe": set(),
    "field_ranges": {"errors"},  # the config schemas' declared ranges (nvfp4_recipe's wheel lacks it)
    "data": {"errors", "field_ranges"},
    "model": _FLOOR,
    "training": _FLOOR | {"model", "data"},
    "launch": _FLOOR | {"training", "model", "data"},
    "benchmarks": _FLOOR | {"training", "model", "data"},
    "studies": _FLOOR | {"benchmarks", "training", "model", "data"},
}
# Modules allowed to reach up a layer, with the reason; none today (the Hugging Face export, which
# reads a run's checkpoint, lives in training/hf_export.py, model/hf.py only maps the weights).
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


def test_the_walker_sees_deferred_and_aliased_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import compat as c\n"
                      "def f():\n    from training.plan import build_plan\n"
                      "    import model.build\n"
                      "from . import sibling\nimport numpy\n")
    assert imported_packages(module) == {"compat", "training", "model"}

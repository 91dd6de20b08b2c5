"""What `pip install` puts into site-packages: the nvfp4_recipe library and nothing else. The
application's generic names (data, model, training, tools, launch, benchmarks, studies, compat)
run from the checkout and would collide with other code if installed. And the library stands
alone: a fresh interpreter that imports its numerics loads neither megatron nor TE."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NOT_SOURCES = shutil.ignore_patterns(".git", ".venv", ".cache", "runs", "build", ".wheels",
                                     "__pycache__", "*.egg-info", ".pytest_cache", ".hypothesis")


def test_the_wheel_holds_only_the_nvfp4_recipe_library(tmp_path):
    # Built from a copy: a build in the checkout would write build/ and *.egg-info into it.
    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=NOT_SOURCES)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "--quiet", "--wheel-dir", str(tmp_path / "dist"), str(source)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [wheel] = (tmp_path / "dist").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top_level == {"nvfp4_recipe"}
    library = {str(p.relative_to(REPO)) for p in (REPO / "nvfp4_recipe").rglob("*.py")}
    assert library <= set(names), f"missing from the wheel: {sorted(library - set(names))}"


def test_importing_the_numerics_imports_neither_megatron_nor_te():
    code = ("import sys, nvfp4_recipe, nvfp4_recipe.policy, nvfp4_recipe.registry, "
            "nvfp4_recipe.gemm_support\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'megatron', 'transformer_engine'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"

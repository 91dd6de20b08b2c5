"""The pieces of the offline GPU check that can be proven on CPU: the Triton-SSD comparison's
loader and its verdicts (model/ssd_check.py), and the offline install of launch/gpu_check.sh.
The script's whole CPU mode runs in tests/benchmarks/test_bench.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from errors import ExitCode
from model import ssd_check
from model.ssd import ssd_chunk_scan

REPO = Path(__file__).resolve().parents[2]
SMALL = ssd_check.Case("small", 2, 100, 4, 16, 2, 16, 32)  # 100 = 3 x 32 + 4: a partial chunk


def _write(root: Path, files: dict) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


@pytest.fixture
def fake_mamba(tmp_path, monkeypatch):
    """A mamba_ssm laid out like 2.3.2.post1 built with MAMBA_SKIP_CUDA_BUILD: its __init__ needs
    the compiled extension; the Triton SSD and gated-norm modules need only a sibling utils module. Plus an
    importable `triton`, and CUDA reported available, so the loader gets past its early skips."""
    _write(tmp_path, {
        "mamba_ssm/__init__.py": "import selective_scan_cuda\n",
        "mamba_ssm/ops/__init__.py": "",
        "mamba_ssm/ops/triton/__init__.py": "",
        "mamba_ssm/ops/triton/ssd_combined.py": (
            "import os\nfrom mamba_ssm.utils.marker import VALUE\n"
            "DETERMINISTIC_AT_IMPORT = os.environ.get('MAMBA_DETERMINISTIC')\n"
            "def mamba_chunk_scan_combined(*args, **kwargs):\n"
            "    return VALUE, DETERMINISTIC_AT_IMPORT\n"),
        "mamba_ssm/ops/triton/layernorm_gated.py": "def rmsnorm_fn(*args, **kwargs):\n    return 'norm'\n",
        "mamba_ssm/utils/__init__.py": "",
        "mamba_ssm/utils/marker.py": "VALUE = 42\n",
        "triton/__init__.py": "",
    })
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ssd_check, "_LOADED", {})
    monkeypatch.delenv("MAMBA_DETERMINISTIC", raising=False)
    yield tmp_path
    for name in [n for n in sys.modules if n == "mamba_ssm" or n.startswith("mamba_ssm.")]:
        del sys.modules[name]
    if str(tmp_path) in (getattr(sys.modules.get("triton"), "__file__", None) or ""):
        del sys.modules["triton"]  # only the stand-in; a real triton stays


def test_triton_ssd_loads_without_the_package_init(fake_mamba):
    with pytest.raises(ModuleNotFoundError, match="selective_scan_cuda"):
        import mamba_ssm.ops.triton.ssd_combined  # noqa: F401  (the normal import fails)
    fn, how = ssd_check.load_triton_ssd()
    assert fn is not None, how
    # the cheapest-config switch is on while the kernels are decorated, and off again afterwards
    assert fn() == (42, "1") and "MAMBA_DETERMINISTIC" not in os.environ
    assert "without mamba_ssm/__init__.py" in how and "selective_scan_cuda" in how
    assert "the trainer's mixer loads it the same way" in how  # compat.mamba_ssm_triton_kernels
    # nobody else sees the stand-in package
    assert "mamba_ssm" not in sys.modules and "mamba_ssm.ops.triton.ssd_combined" not in sys.modules


def test_triton_ssd_skip_reasons(fake_mamba, monkeypatch):
    (fake_mamba / "mamba_ssm/utils/marker.py").write_text("import einops_that_is_missing\n")
    fn, how = ssd_check.load_triton_ssd()
    assert fn is None and "selective_scan_cuda" in how and "einops_that_is_missing" in how
    monkeypatch.setattr(ssd_check, "_LOADED", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ssd_check.load_triton_ssd() == (None, "needs a CUDA device (mamba_ssm's SSD scan is Triton "
                                                 "kernels); none visible to torch")


def _as_kernel(scan):
    """A PyTorch scan behind mamba_chunk_scan_combined's signature (chunk_size=, z=)."""
    def kernel(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False):
        assert z is None
        return scan(x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus)
    return kernel


def _no_state_passing(x, dt, A, B, C, chunk, D=None, dt_bias=None, dt_softplus=False):
    """A plausible kernel bug: each chunk starts from a zero state."""
    return torch.cat([ssd_chunk_scan(x[:, i:i + chunk], dt[:, i:i + chunk], A, B[:, i:i + chunk],
                                     C[:, i:i + chunk], chunk, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus)
                      for i in range(0, x.shape[1], chunk)], dim=1)


def _softplus_once_too_often(x, dt, A, B, C, chunk, D=None, dt_bias=None, dt_softplus=False):
    return ssd_chunk_scan(x, torch.nn.functional.softplus(dt), A, B, C, chunk, D=D, dt_bias=dt_bias,
                          dt_softplus=dt_softplus)


def test_compare_accepts_the_scan_and_flags_wrong_ones():
    good = ssd_check.compare(_as_kernel(ssd_chunk_scan), SMALL, torch.float32, device="cpu")
    assert good["ok"] and max(e["triton"] for e in good["errors"].values()) < 1e-5
    assert set(good["errors"]) == {"y", *ssd_check.GRADS}
    bf16 = ssd_check.compare(_as_kernel(ssd_chunk_scan), SMALL, torch.bfloat16, device="cpu")
    # the BF16 tolerance leaves room over what BF16 inputs/outputs alone cost the exact algorithm
    assert bf16["ok"] and max(e["triton"] for e in bf16["errors"].values()) < bf16["tolerance"] / 3
    for wrong in (_no_state_passing, _softplus_once_too_often):
        r = ssd_check.compare(_as_kernel(wrong), SMALL, torch.float32, device="cpu")
        assert not r["ok"] and r["errors"]["y"]["triton"] > 10 * r["tolerance"], wrong.__name__


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU skip")
def test_ssd_check_cli_skips_without_cuda(tmp_path, capsys):
    assert ssd_check.main(["--json", str(tmp_path / "r.json")]) == ExitCode.SKIPPED
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("skipped: needs a CUDA device")
    assert json.loads((tmp_path / "r.json").read_text())["loaded"] is False


def _probe_wheel(folder: Path) -> Path:
    """A minimal pure wheel, standing in for the wheelhouse's megatron-core & co."""
    path = folder / "gpu_check_probe-1.0-py3-none-any.whl"
    info = "gpu_check_probe-1.0.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("gpu_check_probe/__init__.py", "VALUE = 7\n")
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: gpu-check-probe\nVersion: 1.0\n")
        z.writestr(f"{info}/WHEEL",
                   "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


@pytest.mark.slow
def test_deps_installs_the_wheelhouse_offline_beside_the_environment(tmp_path):
    wheels, site, out = tmp_path / "wheels", tmp_path / "site", tmp_path / "out"
    wheels.mkdir()
    _probe_wheel(wheels)
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "WHEELS": str(wheels),
           "GPU_CHECK_SITE": str(site), "GPU_CHECK_PARTS": "deps", "PIP_NO_INDEX": "1"}
    proc = subprocess.run(["bash", "launch/gpu_check.sh"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    summary = (out / "summary.md").read_text()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "| deps | ok |" in summary and "| bench | skipped: not in GPU_CHECK_PARTS=deps |" in summary
    assert "Installed offline with --no-deps" in summary and "gpu-check-probe" in summary
    assert (site / "gpu_check_probe" / "__init__.py").exists()  # beside, not inside, the venv
    assert "- ok megatron-core" in summary and "(present)" in summary
    # a second run finds it installed and installs nothing
    proc = subprocess.run(["bash", "launch/gpu_check.sh"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "Installed offline" not in (out / "summary.md").read_text()
    # no wheelhouse where WHEELS points: a failed deps row, exit 1
    env["WHEELS"] = str(tmp_path / "nowhere")
    proc = subprocess.run(["bash", "launch/gpu_check.sh"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    summary = (out / "summary.md").read_text()
    assert proc.returncode == 1
    assert f"| deps | FAILED (WHEELS={tmp_path / 'nowhere'} is not a folder" in summary


@pytest.mark.slow
def test_parts_past_the_runs_budget_are_skipped_with_the_reason(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "GPU_CHECK_NO_INSTALL": "1",
           "GPU_CHECK_SITE": str(tmp_path / "site"), "GPU_CHECK_BUDGET_S": "20"}
    proc = subprocess.run(["bash", "launch/gpu_check.sh"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    summary = (out / "summary.md").read_text()
    assert proc.returncode == 0, proc.stdout[-3000:]  # skipped is not failed
    for name in ("cuda_tests", "gpu_path", "ssd_triton", "demo_bf16", "demo_nvfp4", "bench"):
        assert f"| {name} | skipped: the run's 20 s budget (GPU_CHECK_BUDGET_S) is spent |" in summary


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU skip")
def test_gpu_path_check_skips_without_cuda_and_names_lines_by_repository_path(capsys):
    """launch/gpu_path_check.py (part gpu_path): exit 77 with the reason on CPU; its sync counts
    name this project's lines relative to the repository (what decides a failure) and the
    libraries' relative to site-packages."""
    from launch import gpu_path_check

    assert gpu_path_check.main([]) == gpu_path_check.SKIP_EXIT
    assert capsys.readouterr().out.strip() == "skipped: needs a CUDA device; none visible to torch"
    assert gpu_path_check._where(str(REPO / "nvfp4_recipe" / "nvfp4.py")).startswith(
        gpu_path_check.OURS_PER_MICRO_BATCH)
    import megatron.core.optimizer.clip_grads as clip

    assert gpu_path_check._where(clip.__file__) == "megatron/core/optimizer/clip_grads.py"

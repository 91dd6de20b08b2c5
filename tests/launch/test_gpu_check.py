"""The pieces of the offline GPU check that can be proven on CPU: the Triton-SSD comparison's
loader and its verdicts (model/ssd_check.py), the offline install of launch/gpu_check.sh, its
time plan and resume verdict (launch/gpu_check_plan.py), the GPU-path verdicts
(launch/gpu_path_check.py: syncs per micro-batch from recorded warnings, SDPA backends). The
script itself in its CPU mode (the offline install, the budget, every part):
tests/system/test_launch_scripts.py."""

from __future__ import annotations

import json
import os
import warnings
import sys
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


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU skip")
def test_gpu_path_check_skips_without_cuda_and_names_lines_by_repository_path(capsys):
    """launch/gpu_path_check.py (part gpu_path): exit 77 with the reason on CPU; its sync counts
    name this project's lines relative to the repository (what decides a failure) and the
    libraries' relative to site-packages."""
    from launch import gpu_path_check

    assert gpu_path_check.main([]) == ExitCode.SKIPPED
    assert capsys.readouterr().out.strip() == "skipped: needs a CUDA device; none visible to torch"
    assert gpu_path_check._where(str(REPO / "nvfp4_recipe" / "nvfp4.py")).startswith(gpu_path_check.OURS)
    import megatron.core.optimizer.clip_grads as clip

    assert gpu_path_check._where(clip.__file__) == "megatron/core/optimizer/clip_grads.py"


# -- syncs per micro-batch (part gpu_sync) ----------------------------------------------------------

def _recorded(calls):
    """Warning records as torch's set_sync_debug_mode("warn") leaves them: (file, line, message)."""
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        for filename, lineno, message in calls:
            warnings.warn_explicit(message, UserWarning, filename, lineno)
    return records


def test_per_micro_batch_syncs_leave_out_the_per_step_reads():
    from launch import gpu_path_check as g

    sync = "called a synchronizing CUDA operation"
    controller = (str(REPO / "training/precision.py"), 110, sync)  # diagnostics, once a step
    optimizer = ("/venv/lib/python3.12/site-packages/megatron/core/optimizer/clip_grads.py", 200, sync)
    schedule = ("/venv/lib/python3.12/site-packages/megatron/core/pipeline_parallel/schedules.py", 596, sync)
    ours = (str(REPO / "nvfp4_recipe/nvfp4.py"), 42, sync)  # a bug: one read per micro-batch
    other = (str(REPO / "training/schedules.py"), 90, "some other warning")
    one = _recorded([controller, optimizer, optimizer, schedule, ours, other])
    two = _recorded([schedule, ours, controller, schedule, optimizer, ours, other, optimizer])
    extra = g.per_micro_batch_syncs(one, two)
    assert extra == {"megatron/core/pipeline_parallel/schedules.py:596": 1, "nvfp4_recipe/nvfp4.py:42": 1}
    assert g.ours(extra) == {"nvfp4_recipe/nvfp4.py:42": 1}
    # the controller's read is a sync of ours too: only the per-micro-batch difference leaves it out
    assert "training/precision.py:110" in g.sync_lines(two)
    # a healthy step: per-step reads only, however many -> nothing per micro-batch
    healthy_two = _recorded([controller, optimizer, optimizer, schedule, schedule])
    assert g.ours(g.per_micro_batch_syncs(_recorded([controller, optimizer, optimizer, schedule]),
                                          healthy_two)) == {}
    # fewer syncs with two micro-batches is not negative: nothing listed
    assert g.per_micro_batch_syncs(one, _recorded([controller])) == {}
    # the verdict: the per-step read must show in both steps (else nothing was recorded at all)
    assert g.sync_verdict(_recorded([controller, optimizer]), healthy_two)[0]
    ok, extra, mine, problem = g.sync_verdict(one, two)
    assert not ok and mine == {"nvfp4_recipe/nvfp4.py:42": 1} and problem == "1 per micro-batch from this project's code"
    assert g.sync_verdict([], []) == (False, {}, {}, "the controller's read of the diagnostics was not recorded in both steps")
    assert not g.sync_verdict(_recorded([optimizer]), healthy_two)[0]


def test_a_sync_made_through_a_library_wrapper_is_placed_at_our_calling_line():
    """torch warns at the innermost Python frame: a per-micro-batch `.item()` of ours reached
    through a torch or megatron wrapper would be counted as the library's and pass. The recorder
    places it at our innermost frame; a warning with none of ours on the stack stays where it is."""
    from launch import gpu_path_check as g

    library = compile("import warnings\n"
                      "def wrapper():\n"
                      "    warnings.warn('called a synchronizing CUDA operation')\n",
                      "/venv/lib/python3.12/site-packages/torch/wrapper.py", "exec")
    scope = {}
    exec(library, scope)
    ours = compile("def step(wrapper):\n"
                   "    wrapper()\n", str(REPO / "nvfp4_recipe" / "pretend.py"), "exec")
    exec(ours, scope)
    with g.warnings_at_our_frames() as records:
        scope["step"](scope["wrapper"])  # ours -> the library's wrapper -> the warning
        scope["wrapper"]()  # the library alone
    assert g.sync_lines(records) == {"nvfp4_recipe/pretend.py:2": 1, "torch/wrapper.py:3": 1}
    stack = [("/venv/lib/python3.12/site-packages/megatron/core/a.py", 7),
             (str(REPO / "training" / "trainer.py"), 218), (str(REPO / "model" / "stack.py"), 40),
             ("/venv/lib/python3.12/site-packages/torch/b.py", 3)]
    assert g.innermost_of_ours(stack) == (str(REPO / "model" / "stack.py"), 40)
    assert g.innermost_of_ours(stack[-1:]) is None


# -- SDPA on the project's layout (part gpu_path) ---------------------------------------------------

def test_sdpa_backend_names_and_verdict():
    from launch import gpu_path_check as g

    assert g.backend_from_ops(["aten::linear", "aten::_scaled_dot_product_cudnn_attention"]) == "cudnn"
    assert g.backend_from_ops(["aten::_scaled_dot_product_flash_attention_for_cpu"]) == "flash"
    assert g.backend_from_ops(["aten::_scaled_dot_product_efficient_attention_backward"]) == "efficient"
    assert g.backend_from_ops(["aten::_scaled_dot_product_attention_math"]) == "math"
    assert g.backend_from_ops(["aten::mm"]) is None
    good = {"math": {"errors": {"out": 3e-3, "dqkv": 5e-3}},
            "cudnn": {"errors": {"out": 4e-3, "dqkv": 9e-3}},
            "flash": {"errors": {"out": 3e-3, "dqkv": 6e-3}},
            "efficient": {"rejected": "Efficient attention does not support enable_gqa"}}
    assert g.sdpa_verdict(good, "cudnn") == (True, [])
    ok, problems = g.sdpa_verdict({**good, "flash": {"errors": {"out": 3e-3, "dqkv": 0.4}}}, "cudnn")
    assert not ok and problems == ["flash dqkv: relative error 4.00e-01 > 2.00e-02"]
    assert not g.sdpa_verdict({**good, "cudnn": {"errors": {"out": float("nan"), "dqkv": 0.0}}}, "cudnn")[0]
    # a noisier baseline lets fused kernels be proportionally noisier (SDPA_FACTOR), not more
    noisy = {**good, "math": {"errors": {"out": 3e-3, "dqkv": 1e-2}},
             "flash": {"errors": {"out": 3e-3, "dqkv": 3.9e-2}}}
    assert g.sdpa_verdict(noisy, "flash")[0] and not g.sdpa_verdict(
        {**noisy, "flash": {"errors": {"out": 3e-3, "dqkv": 4.1e-2}}}, "flash")[0]
    assert g.sdpa_verdict(good, "math") == (False, ["torch picks the math fallback for this layout"])
    assert not g.sdpa_verdict(good, None)[0]
    rejected = {b: {"rejected": "no"} for b in ("cudnn", "flash", "efficient")}
    assert "every fused backend rejects this layout" in g.sdpa_verdict({**good, **rejected}, "math")[1]
    assert not g.sdpa_verdict({"flash": good["flash"]}, "flash")[0]  # no baseline, no verdict


def test_sdpa_check_runs_the_project_attention_on_fused_qkv_views(monkeypatch):
    """The sdpa section itself, on CPU at a small shape: SDPACoreAttention on strided views of one
    fused QKV buffer, each backend forced, BF16 against FP32 math. On a CPU torch has the flash
    kernel (its _for_cpu form) and math; cuDNN and mem-efficient refuse."""
    from launch import gpu_path_check as g

    mixed, q, k, v = g._fused_qkv_views(16, 2, 8, 2, 32, torch.float32, "cpu")
    # k and v: strided views into the fused buffer (after each group's 4 query heads); q: the copy
    # megatron's reshape of the per-group query makes; all three permuted by SDPACoreAttention
    assert not k.is_contiguous() and not v.is_contiguous() and q.is_contiguous()
    assert k.data_ptr() == mixed.data_ptr() + 4 * 32 * 4 and v.data_ptr() == k.data_ptr() + 32 * 4
    assert k.stride() == (2 * 2 * 6 * 32, 2 * 6 * 32, 6 * 32, 1)
    out = {}
    assert g.check_sdpa(out, "cpu", (("tiny", 48, 2, 8, 2, 32),))
    r = out["sdpa"]["tiny"]
    assert r["picked"] == "flash" and r["problems"] == []
    assert set(r["backends"]) == set(g.SDPA_BACKENDS)
    assert "rejected" in r["backends"]["cudnn"] and "rejected" in r["backends"]["efficient"]
    for backend in ("flash", "math"):
        errors = r["backends"][backend]["errors"]
        assert set(errors) == {"out", "dqkv"} and 0 < max(errors.values()) < g.SDPA_FLOOR
    # a fused kernel that gets the head grouping wrong is caught: query head h with K/V group
    # h % groups (what repeat, not repeat_interleave, gives) instead of h // (heads / groups)
    real = torch.nn.functional.scaled_dot_product_attention

    def wrong_when_fused(q, k, v, enable_gqa=False, **kw):
        if not enable_gqa or torch.backends.cuda.math_sdp_enabled():  # math: the reference stays right
            return real(q, k, v, enable_gqa=enable_gqa, **kw)
        reps = q.shape[1] // k.shape[1]
        return real(q, k.repeat(1, reps, 1, 1), v.repeat(1, reps, 1, 1), **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", wrong_when_fused)
    bad = {}
    assert not g.check_sdpa(bad, "cpu", (("tiny", 48, 2, 8, 2, 32),))
    assert any("relative error" in p for p in bad["sdpa"]["tiny"]["problems"])


# -- the time plan ---------------------------------------------------------------------------------

def test_gpu_plan_runs_correctness_first_and_fits_one_command():
    from launch.gpu_check_plan import BUDGET_S, GPU_PARTS, plan

    names = [p.name for p in GPU_PARTS]
    assert names == ["deps", "gpu_path", "cuda_tests", "ssd_triton", "warmup", "gpu_sync", "demo_bf16",
                     "resume", "demo_nvfp4", "demo_moe", "bench"]
    budget = BUDGET_S["gpu"]
    rows = {r["part"]: r for r in plan(GPU_PARTS, budget)}
    for name in names[:-1]:
        assert rows[name]["run"], rows[name]
    assert not rows["bench"]["run"] and rows["bench"]["reason"].startswith("needs ~120 s, 20 s of the run's 540 s")
    assert sum(p.estimate_s for p in GPU_PARTS if rows[p.name]["run"]) <= budget
    # the worst case: every part runs to its limit and is then killed (kill-after 10 s, as the
    # script's part() leaves 5 s more): the run still ends within the device's 600 s command
    # with the 60 s the script keeps for the machine probe, CUDA start-up and the summary.
    from launch.gpu_check_plan import decide

    elapsed, kill_after = 0.0, 10
    for part in GPU_PARTS:
        limit, _ = decide(part, budget - elapsed - kill_after - 5, budget)
        if limit is not None:
            elapsed += limit + kill_after
    assert elapsed <= budget and budget + 60 <= 600


def test_decide_caps_the_limit_and_skips_with_the_reason():
    from launch.gpu_check_plan import MIN_PART_S, Part, decide, plan

    part = Part("x", 40, 90, "")
    assert decide(part, 500, 540) == (90, "")
    assert decide(part, 60, 540) == (60, "")  # never past the budget
    assert decide(part, 39, 540) == (None, "needs ~40 s, 39 s of the run's 540 s budget (GPU_CHECK_BUDGET_S) left")
    assert decide(Part("y", 1, 90, ""), MIN_PART_S - 1, 540)[0] is None
    assert decide(part, -7, 540)[1].startswith("needs ~40 s, 0 s of")
    parts = [Part("a", 50, 60, ""), Part("b", 50, 60, ""), Part("c", 10, 20, "")]
    rows = plan(parts, 100, selected={"a", "b", "c"})
    assert [(r["part"], r["run"], r["limit_s"]) for r in rows] == [("a", True, 60), ("b", True, 50), ("c", False, None)]
    assert plan(parts, 100, selected={"b"})[0]["reason"] == "not in GPU_CHECK_PARTS"


def test_plan_and_decide_from_the_command_line(capsys):
    from launch import gpu_check_plan

    assert gpu_check_plan.main(["decide", "--mode", "gpu", "--part", "warmup", "--left", "500"]) == 0
    assert capsys.readouterr().out == "run 150\n"
    assert gpu_check_plan.main(["decide", "--mode", "gpu", "--part", "bench", "--left", "60", "--budget", "540"]) == 0
    assert capsys.readouterr().out.startswith("skip needs ~120 s, 60 s")
    assert gpu_check_plan.main(["plan", "--mode", "gpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "deps: runs (limit 60 s)" and lines[-1].startswith("bench: skipped: needs ~120 s")


# -- resume (part resume) --------------------------------------------------------------------------

def test_the_resume_part_skips_when_demo_bf16_left_no_checkpoint(tmp_path, capsys):
    """demo_bf16 skipped by the budget (or left out by GPU_CHECK_PARTS): the resume part says
    skipped, not FAILED; a demo_bf16 that ran and failed has its own FAILED row."""
    from errors import ExitCode
    from launch import gpu_check_plan

    code = gpu_check_plan.main(["resume", "--demo", str(tmp_path / "demo_bf16"), "--into",
                                str(tmp_path / "resume"), "--from-step", "30", "--rtol", "0",
                                "--", sys.executable, "-c", "raise SystemExit(3)"])
    assert code == ExitCode.SKIPPED
    assert capsys.readouterr().out.splitlines()[-1].startswith(
        "skipped: no step-30 checkpoint of demo_bf16 to resume")
    assert not (tmp_path / "resume").exists()


def test_compare_resumed_losses():
    from launch.gpu_check_plan import compare_resumed, read_losses

    lines = [json.dumps({"step": s, "loss": 5.0 - s / 10, "lr": 1e-3}) for s in range(1, 33)]
    lines.insert(5, json.dumps({"step": 30, "val_loss": 4.0}))  # a validation record: no "loss"
    full = read_losses(lines + [""])
    assert len(full) == 32 and full[30] == 2.0
    resumed = {31: full[31], 32: full[32]}
    ok, line = compare_resumed(full, resumed, 30, rtol=0, exact_steps=1)
    assert ok and "steps 31-32 from the step-30 checkpoint" in line
    # the first step after the checkpoint must be bitwise; the next within rtol
    assert not compare_resumed(full, {**resumed, 31: full[31] * (1 + 1e-7)}, 30, 1e-3, 1)[0]
    assert compare_resumed(full, {**resumed, 32: full[32] * (1 + 1e-4)}, 30, 1e-3, 1)[0]
    assert not compare_resumed(full, {**resumed, 32: full[32] * (1 + 1e-4)}, 30, 0, 1)[0]
    assert not compare_resumed(full, {**resumed, 32: full[32] * 1.01}, 30, 1e-3, 1)[0]
    assert compare_resumed(full, {31: full[31]}, 30, 0, 1) == (False, "the resumed run logged no loss for steps [32]")
    assert "trained steps [29, 31]"[:13] in compare_resumed(full, {29: 1.0, **resumed}, 30, 0, 1)[1]
    assert not compare_resumed(full, {**resumed, 31: float("nan")}, 30, 0, 1)[0]
    assert compare_resumed({1: 1.0}, {}, 30, 0, 1) == (False, "the uninterrupted run logged no step after 30")


def test_resume_demo_copies_one_checkpoint_and_checks_what_the_run_said(tmp_path):
    """The part's plumbing with a stand-in trainer: only the chosen checkpoint is copied, the run
    must say it resumed from it, and its losses are compared."""
    from launch.gpu_check_plan import resume_demo, step_dir

    demo, into = tmp_path / "demo", tmp_path / "resumed"
    for step in (2, 4):
        step_dir(demo, step).mkdir(parents=True)
        (step_dir(demo, step) / "manifest.json").write_text(json.dumps({"optimizer_layout": "dp_reshardable"}))
    (demo / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 9.0 - s}) + "\n" for s in range(1, 5)))
    fake = ("import json, pathlib, sys\n"
            "d = pathlib.Path(sys.argv[1]); ckpts = sorted(p.name for p in (d / 'checkpoints').iterdir())\n"
            "assert ckpts == ['step_0000002'], ckpts\n"
            "print('resumed from', d / 'checkpoints' / ckpts[0], 'at step 2')\n"
            "(d / 'metrics.jsonl').write_text(''.join(json.dumps({'step': s, 'loss': 9.0 - s + float(sys.argv[2])})"
            " + '\\n' for s in (3, 4)))\n")
    run = [sys.executable, "-c", fake, str(into)]
    ok, why = resume_demo(demo, into, 2, 0.0, 1, run + ["0"])
    assert ok and why.endswith("; optimizer state dp_reshardable"), why
    ok, why = resume_demo(demo, into, 2, 0.0, 1, run + ["0.5"])
    assert not ok and why.startswith("step 3: loss 6.5 resumed vs 6.0 uninterrupted")
    ok, why = resume_demo(demo, into, 2, 0.0, 1, [sys.executable, "-c", "print('started afresh')"])
    assert not ok and "did not say `resumed from`" in why
    ok, why = resume_demo(demo, into, 3, 0.0, 1, run + ["0"])
    assert not ok and "step_0000003 does not exist" in why and "step_0000002" in why
    (step_dir(demo, 2) / "manifest.json").write_text(json.dumps({"optimizer_layout": "fully_reshardable"}))
    assert resume_demo(demo, into, 2, 0.0, 1, run + ["0"]) == (
        False, "the checkpoint holds the optimizer state in layout 'fully_reshardable', not 'dp_reshardable'")

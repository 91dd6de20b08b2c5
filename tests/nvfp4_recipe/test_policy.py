"""The precision policy and the TE mapping: pure functions, no megatron or TE needed."""

import pytest

from nvfp4_recipe.policy import PrecisionConfig, PrecisionPolicy, SwitchToBF16Config
from nvfp4_recipe.megatron.te_mapping import probe_te_support, te_recipe_rule, te_recipe_spec, te_supports

PATTERN_12B = "M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M-"
KINDS_12B = [{"M": "mamba", "*": "attention", "-": "mlp"}[c] for c in PATTERN_12B]


def nvfp4(**overrides) -> PrecisionConfig:
    return PrecisionConfig(name="nvfp4", format="nvfp4", **overrides)


def test_12b_nvfp4_keeps_first_2_and_last_8_layers_in_bf16():
    policy = PrecisionPolicy(nvfp4(), KINDS_12B, model_first=2, model_last=8)
    bf16 = [d.index for d in policy.layers() if d.format == "bf16"]
    assert bf16 == [0, 1, *range(54, 62)]
    # two linears per pattern layer: 20 of 124 in BF16
    assert 2 * len(bf16) == 20 and 2 * len(policy.layers()) == 124


def test_bf16_last_layers_override_moves_exactly_those_layers():
    policy = PrecisionPolicy(nvfp4(bf16_last_layers=4), KINDS_12B, model_first=2, model_last=8)
    bf16 = [d.index for d in policy.layers() if d.format == "bf16"]
    assert bf16 == [0, 1, 58, 59, 60, 61]


def test_bf16_recipe_has_no_low_precision_layer():
    policy = PrecisionPolicy(PrecisionConfig(), KINDS_12B, model_first=2, model_last=8)
    assert {d.format for d in policy.layers()} == {"bf16"}


@pytest.mark.parametrize(
    "first,last,message",
    [(-1, 2, "bf16_first_layers=-1 is negative"),
     (2, 63, "bf16_last_layers=63 is larger than the model depth (62 layers)"),
     (40, 30, "overlap")],
)
def test_bf16_layer_counts_are_range_checked(first, last, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        PrecisionPolicy(nvfp4(bf16_first_layers=first, bf16_last_layers=last), KINDS_12B)


@pytest.mark.parametrize(
    "overrides,key",
    [({"format": "fp6"}, "precision.format='fp6'"),
     ({"backend": "cuda"}, "precision.backend='cuda'"),
     ({"switch_to_bf16": SwitchToBF16Config(at_fraction=1.5)}, "at_fraction=1.5"),
     ({"switch_to_bf16": SwitchToBF16Config(passes="backward")}, "passes='backward'")],
)
def test_bad_values_name_the_key(overrides, key):
    """Refused where the config is made (PrecisionConfig.__post_init__, which OmegaConf.to_object
    runs), naming the key."""
    with pytest.raises(ValueError) as err:
        PrecisionPolicy(PrecisionConfig(**{"format": "nvfp4", **overrides}), KINDS_12B)
    assert key in str(err.value)


@pytest.mark.parametrize(
    "rht,sr,two_d",
    [(True, True, True), (False, True, True), (True, False, True), (True, True, False),
     (False, False, False)],
)
def test_te_mapping_inverts_each_switch(rht, sr, two_d):
    spec = te_recipe_spec(nvfp4(rht=rht, stochastic_rounding=sr, weight_2d=two_d))
    assert spec == {
        "recipe": "NVFP4BlockScaling",
        "kwargs": {"disable_rht": not rht, "disable_stochastic_rounding": not sr,
                   "disable_2d_quantization": not two_d},
    }


def test_te_mapping_of_other_formats():
    assert te_recipe_spec(PrecisionConfig()) is None
    assert te_recipe_spec(PrecisionConfig(format="fp8"))["recipe"] == "Float8BlockScaling"
    assert te_recipe_spec(PrecisionConfig(format="mxfp4")) is None


def test_te_support_names_the_missing_capability():
    ok, why = te_supports(nvfp4(), (9, 0), "12.9", "2.9.0")
    assert not ok and why == "NVFP4 TE GEMMs need compute capability 10.x, found 9.0"
    assert te_supports(nvfp4(), (10, 0), "12.9", "2.9.0") == (True, "")
    assert te_supports(nvfp4(), None, None, "2.9.0") == (False, "no CUDA device")
    assert te_supports(PrecisionConfig(format="fp8"), (9, 0), "12.9", "2.9.0") == (True, "")
    assert te_supports(PrecisionConfig(format="mxfp4"), (10, 0), "12.9", "2.9.0")[0] is False


# TE's own rules, which auto's fallback reason repeats: v2.8 fp8.py:57-72,
# v2.9 quantization.py:71-86, v2.18 quantization.py:171-185.
@pytest.mark.parametrize(
    "capability,cuda,te,expected",
    [((9, 0), "12.8", "2.9.0", "FP8 block scaling needs CUDA 12.9 or newer, found 12.8"),
     ((9, 0), None, "2.9.0", "FP8 block scaling needs CUDA 12.9 or newer, found None"),
     ((9, 0), "12.9", "2.9.0", ""),
     ((9, 0), "13.0", "2.8.0", ""),
     ((8, 9), "12.9", "2.9.0",
      "FP8 block scaling needs compute capability 9.0 or newer, found 8.9"),
     ((10, 0), "12.9", "2.8.0+cu129", "transformer_engine 2.8.0+cu129 runs FP8 block scaling on "
                                      "compute capability 9.x only (10.x from TE 2.9), found 10.0"),
     ((10, 0), "12.9", "2.9.0", ""),
     ((10, 3), "13.0", "2.18.0", ""),
     ((9, 0), "12.9", "2.2.1", "Float8BlockScaling needs transformer_engine >= 2.3, found 2.2.1")],
)
def test_fp8_block_scaling_rule_by_cuda_capability_and_te(capability, cuda, te, expected):
    ok, why = te_supports(PrecisionConfig(format="fp8"), capability, cuda, te)
    assert (ok, why) == (expected == "", expected)


@pytest.mark.parametrize(
    "capability,te,expected",
    [((10, 0), "2.7.0", "NVFP4BlockScaling needs transformer_engine >= 2.8, found 2.7.0"),
     ((10, 0), "2.8.0", ""), ((10, 3), "2.10.0.dev0+abc", ""),
     ((9, 0), "2.9.0", "TE NVFP4 needs compute capability 10.0 or newer, found 9.0"),
     ((10, 0), "unknown", "unknown transformer_engine version 'unknown'")],
)
def test_nvfp4_rule_by_te_release(capability, te, expected):
    ok, why = te_recipe_rule("nvfp4", capability, "12.9", te)
    assert (ok, why) == (expected == "", expected)


# TE's MXFP8 rule: the recipe from v2.0 (common/recipe/__init__.py:165), cc >= 10.0 (v2.0
# fp8.py:41), and from v2.6 not on 12.x (v2.6 fp8.py:49-52, v2.18 quantization.py:162-168).
@pytest.mark.parametrize(
    "capability,te,expected",
    [((10, 0), "1.13.0", "MXFP8BlockScaling needs transformer_engine >= 2.0, found 1.13.0"),
     ((10, 0), "2.0.0", ""), ((10, 3), "2.18.0", ""),
     ((9, 0), "2.18.0", "TE MXFP8 needs compute capability 10.0 or newer, found 9.0"),
     ((12, 0), "2.5.0", ""),
     ((12, 0), "2.6.0", "transformer_engine 2.6.0 does not run MXFP8 on compute capability 12.0")],
)
def test_mxfp8_rule_by_te_release(capability, te, expected):
    ok, why = te_recipe_rule("mxfp8", capability, "12.9", te)
    assert (ok, why) == (expected == "", expected)


def test_mxfp8_runs_on_te_only_on_blackwell_datacenter_parts():
    mxfp8 = PrecisionConfig(format="mxfp8")
    assert te_supports(mxfp8, (10, 0), "12.9", "2.9.0") == (True, "")
    assert te_supports(mxfp8, (9, 0), "12.9", "2.9.0") == (
        False, "MXFP8 TE GEMMs need compute capability 10.x, found 9.0")
    assert te_supports(mxfp8, (12, 0), "12.9", "2.5.0")[0] is False  # this project's own rule


# -- probe_te_support: asks the installed TE (faked here; TE is not installed on CPU) -----------

def _fake_te(monkeypatch, version: str, manager=None, *, where: str = "quantization"):
    """Install a fake transformer_engine whose FP8GlobalStateManager lives in `where`
    ("quantization": TE >= 2.9, "fp8": TE 2.8)."""
    import sys
    import types

    te = types.ModuleType("transformer_engine")
    te.__version__ = version
    modules = {"transformer_engine": te,
               "transformer_engine.pytorch": types.ModuleType("transformer_engine.pytorch"),
               "transformer_engine.pytorch.quantization": None,
               "transformer_engine.pytorch.fp8": None}
    holder = types.ModuleType(f"transformer_engine.pytorch.{where}")
    holder.FP8GlobalStateManager = manager or type("FP8GlobalStateManager", (), {})
    modules[f"transformer_engine.pytorch.{where}"] = holder
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)  # None: that import raises ImportError


def _manager(**checks):
    return type("FP8GlobalStateManager", (), {
        name: classmethod(lambda cls, _answer=answer: _answer) for name, answer in checks.items()})


@pytest.mark.parametrize("where,version", [("quantization", "2.9.0"), ("fp8", "2.8.0")])
def test_probe_takes_tes_own_verdict(monkeypatch, where, version):
    """TE's FP8GlobalStateManager answers first, where 2.8 (fp8.py) or 2.9+ (quantization.py)
    keeps it, even where our version rule would say yes."""
    import torch

    monkeypatch.setattr(torch.version, "cuda", "12.9")
    reason = "FP8 block scaled GEMM requires Hopper and CUDA >= 12.9."
    _fake_te(monkeypatch, version, _manager(is_fp8_block_scaling_available=(False, reason),
                                            is_nvfp4_available=(True, "")), where=where)
    assert probe_te_support(PrecisionConfig(format="fp8"), (9, 0)) == (
        False, f"transformer_engine: {reason}")
    assert probe_te_support(nvfp4(), (10, 0)) == (True, "")


def test_probe_falls_back_to_the_version_rule(monkeypatch):
    """A TE without the check (no FP8GlobalStateManager method): our restatement of its rule."""
    import torch

    monkeypatch.setattr(torch.version, "cuda", "12.4")
    _fake_te(monkeypatch, "2.9.0")
    assert probe_te_support(PrecisionConfig(format="fp8"), (9, 0)) == (
        False, "FP8 block scaling needs CUDA 12.9 or newer, found 12.4")


def test_probe_keeps_the_project_rule_before_asking_te(monkeypatch):
    _fake_te(monkeypatch, "2.9.0", _manager(is_nvfp4_available=(True, "")))
    assert probe_te_support(nvfp4(), (12, 0)) == (
        False, "NVFP4 TE GEMMs need compute capability 10.x, found 12.0")


def test_probe_turns_a_missing_or_broken_te_into_a_reason(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    ok, why = probe_te_support(PrecisionConfig(format="fp8"), (9, 0))
    assert not ok and why.startswith("transformer_engine not usable (ModuleNotFoundError")

    def broken(cls):
        raise RuntimeError("CUDA driver version is insufficient")

    _fake_te(monkeypatch, "2.9.0", type("M", (), {"is_nvfp4_available": classmethod(broken)}))
    assert probe_te_support(nvfp4(), (10, 0)) == (
        False, "transformer_engine not usable (RuntimeError: CUDA driver version is insufficient)")

"""The format registry (nvfp4_recipe/registry.py), the precision schema's choice fields, and the
torch-only boundary of `nvfp4_recipe` (megatron-core lives in `nvfp4_recipe.megatron`; what a
fresh interpreter loads with the numerics: tests/system/test_packaging.py)."""

from types import SimpleNamespace

import pytest
import torch
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from nvfp4_recipe import quantization_error_stats, quantized_linear
from nvfp4_recipe.policy import PrecisionConfig
from nvfp4_recipe.registry import FORMAT_SPECS, Format, format_spec, gemm_config_for, spec_of_config
from train_helpers import compose_train


def test_every_format_is_registered_once_and_its_config_finds_it_again():
    assert list(FORMAT_SPECS) == list(Format)
    cfg = PrecisionConfig(format="nvfp4", rht=False, gemm="exact")
    for fmt in Format:
        config = gemm_config_for(fmt, cfg)
        if fmt == "bf16":
            assert config is None and format_spec(fmt).ops is None
            continue
        assert type(config) is format_spec(fmt).config_type and config.gemm == "exact"
        assert spec_of_config(config).format == fmt
    assert gemm_config_for("nvfp4", cfg).rht is False


# Relative RMS quantization error ||Q(w) - w|| / ||w|| of a Gaussian tensor, per format, from its
# element format's mantissa: with m mantissa bits a value's rounding error is at most half a step,
# between 2**-(m+2) and 2**-(m+1) of its magnitude (the step is 2**-m of the value's power of
# two), and roughly uniform within it, so its RMS is that over sqrt(3). Block scales put nearly
# all of a Gaussian's energy in each format's normal range. A format with one mantissa bit more or
# less lands outside (FP8 E5M2 measures 0.053; E2M1 formats ~0.1; no quantization 0).
_E2M1_BOUNDS = (2**-3 / 3**0.5, 2**-2 / 3**0.5)  # 1 mantissa bit: 0.072 .. 0.144
REL_ERROR_BOUNDS = {
    "nvfp4": _E2M1_BOUNDS,
    "mxfp4": _E2M1_BOUNDS,
    "fp8": (2**-5 / 3**0.5, 2**-4 / 3**0.5),  # E4M3, 3 mantissa bits: 0.018 .. 0.036
    "mxfp8": (2**-5 / 3**0.5, 2**-4 / 3**0.5),  # E4M3 elements too, power-of-two block scales
}


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "mxfp4", "mxfp8"])
def test_each_format_runs_its_linear_and_its_diagnostics(fmt):
    gen = torch.Generator().manual_seed(0)
    config = gemm_config_for(fmt, PrecisionConfig(format=fmt))
    x, w = torch.randn(4, 128, generator=gen), torch.randn(128, 128, generator=gen)
    assert quantized_linear(x, w, None, config).shape == (4, 128)
    low, high = REL_ERROR_BOUNDS[fmt]
    for role in ("weight", "activation"):
        rel = float(quantization_error_stats(w, config, role=role)["rel_error"])
        assert low < rel < high, (fmt, role, rel)


def test_nvfp4_scales_lose_less_than_mxfp4_power_of_two_scales():
    # Same E2M1 elements: NVFP4's E4M3 scale maps each 16-block's max to ~6, the top of the grid;
    # MXFP4's power-of-two scale leaves a 32-block's max anywhere in [4, 8), using less of the grid
    # (and clipping above 6). Measured 0.095 against 0.115 on this tensor.
    w = torch.randn(128, 128, generator=torch.Generator().manual_seed(0))
    cfg = PrecisionConfig(format="nvfp4")
    nvfp4, mxfp4 = (float(quantization_error_stats(w, gemm_config_for(f, cfg), role="activation")
                          ["rel_error"]) for f in ("nvfp4", "mxfp4"))
    assert nvfp4 < 0.9 * mxfp4


def test_an_unregistered_config_or_format_is_refused():
    unknown = SimpleNamespace(quantize_forward=True, quantize_backward=True, gemm="fast")
    with pytest.raises(ValueError, match="config of type SimpleNamespace is not supported"):
        quantized_linear(torch.randn(2, 16), torch.randn(16, 16), None, unknown)
    with pytest.raises(ValueError, match="unknown GEMM format 'fp6': choose one of bf16, nvfp4"):
        format_spec("fp6")


# Every choice field of the precision schema, with its values as YAML and the command line spell them.
CHOICES = {
    "precision.format": ["bf16", "nvfp4", "fp8", "mxfp4", "mxfp8"],
    "precision.backend": ["auto", "te", "emulated"],
    "precision.gemm": ["fast", "exact"],
    "precision.kernels": ["auto", "eager", "compiled"],
    "precision.switch_to_bf16.passes": ["forward", "all"],
}


@pytest.mark.parametrize("key", sorted(CHOICES))
def test_a_precision_choice_outside_its_values_is_refused_naming_them(key):
    if key == "precision.format":  # a name or a map of passes: the schema's own check
        with pytest.raises(ValueError) as err:
            compose_train(f"{key}=sometimes")
        assert f"{key}='sometimes': choose one of {', '.join(CHOICES[key])}" in str(err.value)
        return
    with pytest.raises(ConfigCompositionException) as err:
        compose_train(f"{key}=sometimes")
    text = str(err.value.__cause__)
    assert f"Invalid value 'sometimes', expected one of [{', '.join(CHOICES[key])}]" in text, text


@pytest.mark.parametrize("key", sorted(CHOICES))
def test_every_precision_choice_composes_and_keeps_its_spelling(key):
    """Code compares the values with plain strings, and config.yaml spells them as before."""
    *path, field = key.split(".")
    for value in CHOICES[key]:
        cfg = compose_train(f"{key}={value}")
        node = cfg
        for part in path:
            node = getattr(node, part)
        assert getattr(node, field) == value and f"{getattr(node, field)}" == value
        assert f"{field}: {value}\n" in OmegaConf.to_yaml(OmegaConf.structured(cfg))

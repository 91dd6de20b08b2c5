"""The GEMM preflight of a linear with a format per pass (`"fprop/dgrad/wgrad"`): each GEMM is
checked under its own pass's rules, and the emulated block rule where the emulation checks it."""

import pytest
import torch

from nvfp4_recipe import quantized_linear
from nvfp4_recipe.gemm_support import Linear, Setting, check_linear
from nvfp4_recipe.policy import PrecisionConfig
from nvfp4_recipe.registry import pass_configs_for

T = 8192


def checks(fmt: str, n: int, backend: str, k: int = 4096) -> dict:
    linear = Linear("layers.2.mixer.out_proj", fmt, in_features=k, out_features=n)
    return {c.gemm: (c.format, c.verdict, [r.split(":")[0] for r in c.reasons])
            for c in check_linear(linear, Setting(backend=backend, tokens=T))}


def test_each_gemm_is_checked_under_its_own_passs_format_on_te():
    # N = 2064: whole 16-blocks (NVFP4), not 32-blocks (MXFP8). W and dY hold N.
    got = checks("mxfp8/nvfp4/nvfp4", 2064, "te")
    assert got["fprop"][:2] == ("mxfp8", "fail") and got["fprop"][2] == ["te.mxfp8.quantize_32"]
    assert {g: got[g][0] for g in ("dgrad", "wgrad")} == {"dgrad": "nvfp4", "wgrad": "nvfp4"}
    assert "te.mxfp8.quantize_32" not in got["dgrad"][2] + got["wgrad"][2]
    assert "te.nvfp4.quantize_16" not in got["dgrad"][2] + got["wgrad"][2]
    # The same shape under NVFP4 alone raises no MXFP8 rule: the map, not the shape, decides.
    assert all("te.mxfp8.quantize_32" not in r for _, _, r in checks("nvfp4", 2064, "te").values())


@pytest.mark.parametrize("fmt,bad_n,first", [("mxfp8/nvfp4/nvfp4", 2064, "fprop"),
                                              ("bf16/nvfp4/nvfp4", 2056, "dgrad"),
                                              ("nvfp4/bf16/mxfp8", 2064, "wgrad")])
def test_the_emulated_block_rule_is_what_the_mixed_linear_does(fmt, bad_n, first):
    """Reported once, on the first GEMM in the failing format, as the emulated linear refuses
    the call before any GEMM (each quantized pass's ops check the shapes)."""
    got = checks(fmt, bad_n, "emulated", k=64)
    assert [g for g, (_, verdict, _) in got.items() if verdict == "fail"] == [first]
    assert checks(fmt, 2048, "emulated", k=64) == {
        g: (f, "ok", []) for g, f in zip(("fprop", "dgrad", "wgrad"), fmt.split("/"))}
    configs = pass_configs_for(*fmt.split("/"), PrecisionConfig(format="nvfp4"))
    x = torch.randn(7, 64)
    quantized_linear(x, torch.randn(2048, 64), None, configs)
    with pytest.raises(ValueError, match="not a multiple"):
        quantized_linear(x, torch.randn(bad_n, 64), None, configs)

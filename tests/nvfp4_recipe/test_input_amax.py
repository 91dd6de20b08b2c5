"""The running input amax of the low-precision linears (nvfp4_recipe/megatron/input_amax.py): what
an NVFP4 serving export's activation scales come from."""

import torch

from nvfp4_recipe.linear import fold_input_amax
from nvfp4_recipe.linear_protocol import HeldLinear
from nvfp4_recipe.megatron.input_amax import InputAmaxRecorder, running_input_amax
from nvfp4_recipe.megatron.te_runtime import TEPrecisionLinear


class Linear(torch.nn.Module):
    """An emulated linear as the recorder sees it (parallel_linear.py's record_input_amax)."""

    input_amax = None

    def record_input_amax(self, into):
        self.input_amax = into
        return True

    def forward(self, x):
        fold_input_amax(self.input_amax, x)
        return x


def recorder(window=3):
    mods = {"layers.1.mlp.linear_fc1": Linear(), "layers.2.mixer.in_proj": Linear()}
    names = ["layers.1.mlp.linear_fc1", "layers.2.mixer.in_proj", "layers.3.mixer.in_proj",
             "layers.4.mixer.in_proj"]
    held = [HeldLinear(n, "nvfp4", m) for n, m in mods.items()]
    held.append(HeldLinear("layers.4.mixer.in_proj", "nvfp4",  # TE's: cannot record
                           TEPrecisionLinear(torch.nn.Linear(1, 1))))
    held.append(HeldLinear("layers.5.mixer.in_proj", "bf16", Linear()))  # not a column
    return InputAmaxRecorder(names, held, window), mods


def test_a_window_of_per_step_maxima_non_finite_ignored():
    rec, mods = recorder(window=3)
    fc1, in_proj = mods.values()
    for step, value in enumerate([5.0, 2.0, 3.0, 1.0]):
        fc1(torch.tensor([value, -value / 2]))
        fc1(torch.tensor([-value * 0.9, float("nan"), float("inf")]))  # NaN/Inf count as 0
        in_proj(torch.tensor([-(step + 1.0)]))
        rec.end_step()
    amax, steps = running_input_amax(rec.state_dict())
    # The last 3 steps: 5.0 has left the window; layers.3 is not held here and layers.4 is TE's:
    # not recorded.
    assert steps == 3 and amax == {"layers.1.mlp.linear_fc1": 3.0, "layers.2.mixer.in_proj": 4.0}
    assert float(fc1.input_amax) == 0.0  # zeroed for the next step


def test_state_round_trips_by_name_and_a_shorter_window_keeps_the_newest():
    rec, mods = recorder(window=4)
    fc1 = mods["layers.1.mlp.linear_fc1"]
    for value in (7.0, 1.0, 2.0):
        fc1(torch.tensor([value]))
        rec.end_step()
    state = rec.state_dict()
    again, _ = recorder(window=4)
    again.load_state_dict(state)
    assert running_input_amax(again.state_dict()) == running_input_amax(state)
    short, _ = recorder(window=2)
    short.load_state_dict(state)
    assert running_input_amax(short.state_dict()) == (
        {"layers.1.mlp.linear_fc1": 2.0, "layers.2.mixer.in_proj": 0.0}, 2)
    # A checkpoint without the table (older, or input_amax_steps=0) has nothing recorded.
    assert running_input_amax(None) == ({}, 0)
    off, off_mods = recorder(window=0)
    assert off_mods["layers.1.mlp.linear_fc1"].input_amax is None  # not recording at all
    off.end_step()
    assert running_input_amax(off.state_dict()) == ({}, 0)


# -- the amax the quantizer already computed, not another pass over the input ---------------------

import pytest  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from nvfp4_recipe import FP8BlockConfig, MXFP4Config, NVFP4Config, PassConfigs, quantized_linear  # noqa: E402

CONFIGS = {
    "nvfp4": NVFP4Config(),
    "nvfp4 backward only": PassConfigs(None, NVFP4Config(), NVFP4Config()),
    "mxfp4": MXFP4Config(),
    "fp8 block": FP8BlockConfig(),
    "off": PassConfigs(),
}


def _inputs(scale=3.0):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 32, 128, generator=gen) * scale).to(torch.bfloat16)
    w = (torch.randn(128, 128, generator=gen) / 11).to(torch.bfloat16)
    return x, w


@pytest.mark.parametrize("name", list(CONFIGS))
def test_quantized_linear_folds_max_abs_x_of_its_input(name):
    """The recorded value is max |x| exactly (the reference: float64 |x|, max), whichever way it
    was found; it only grows, and a non-finite input counts as 0."""
    x, w = _inputs()
    amax = torch.zeros(())
    quantized_linear(x, w, None, CONFIGS[name], input_amax=amax)
    assert float(amax) == x.double().abs().max().item()
    quantized_linear(x / 4, w, None, CONFIGS[name], input_amax=amax)  # a smaller input
    assert float(amax) == x.double().abs().max().item()
    bad = x.clone()
    bad[0, 0, 0] = float("nan")
    fresh = torch.zeros(())
    quantized_linear(bad, w, None, CONFIGS[name], input_amax=fresh)
    assert float(fresh) == 0.0


def test_nvfp4_reuses_its_quantizers_amax_instead_of_another_pass(monkeypatch):
    """NVFP4's Fprop quantizer computes the tensor amax of x; the recorder takes it, with no
    second pass over x (neither |x| nor aminmax). The other formats' block scales are not max |x|
    exactly (MXFP4's are powers of two, FP8's amax / 448): they keep one aminmax pass."""
    calls = []
    real = torch.aminmax
    monkeypatch.setattr(torch, "aminmax", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, w = _inputs()
    quantized_linear(x, w, None, NVFP4Config(), input_amax=torch.zeros(()))
    assert calls == []
    quantized_linear(x, w, None, MXFP4Config(), input_amax=torch.zeros(()))
    assert calls == [1]


def test_a_recomputed_forward_records_nothing():
    """Activation recompute reruns the forward inside the backward (on CPU torch's reentrant
    checkpoint, model/recompute.py; megatron's CheckpointFunction alike): the first forward recorded that input already, so
    the rerun does not fold it in again (here: the window was zeroed in between, as end_step
    does, and stays zero)."""
    x, w = _inputs()
    x.requires_grad_()
    w.requires_grad_()
    amax = torch.zeros(())
    y = checkpoint(lambda a, b: quantized_linear(a, b, None, NVFP4Config(), input_amax=amax),
                   x, w, use_reentrant=True)
    assert float(amax) == x.detach().double().abs().max().item()
    amax.zero_()
    y.float().sum().backward()
    assert x.grad is not None and float(amax) == 0.0

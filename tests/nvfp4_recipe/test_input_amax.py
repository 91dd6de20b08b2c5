"""The running input amax of the low-precision linears (nvfp4_recipe/megatron/input_amax.py): what
an NVFP4 serving export's activation scales come from (issue 27)."""

import torch

from nvfp4_recipe.megatron.input_amax import (InputAmaxRecorder, record_input_amax,
                                              running_input_amax)


class Linear(torch.nn.Module):
    input_amax = None  # as parallel_linear's emulated linears declare it

    def forward(self, x):
        record_input_amax(self.input_amax, x)
        return x


def recorder(window=3):
    mods = {"layers.1.mlp.linear_fc1": Linear(), "layers.2.mixer.in_proj": Linear()}
    names = ["layers.1.mlp.linear_fc1", "layers.2.mixer.in_proj", "layers.3.mixer.in_proj"]
    return InputAmaxRecorder(names, mods, window), mods


def test_a_window_of_per_step_maxima_non_finite_ignored():
    rec, mods = recorder(window=3)
    fc1, in_proj = mods.values()
    for step, value in enumerate([5.0, 2.0, 3.0, 1.0]):
        fc1(torch.tensor([value, -value / 2]))
        fc1(torch.tensor([-value * 0.9, float("nan"), float("inf")]))  # NaN/Inf count as 0
        in_proj(torch.tensor([-(step + 1.0)]))
        rec.end_step()
    amax, steps = running_input_amax(rec.state_dict())
    # The last 3 steps: 5.0 has left the window; layers.3 is not held here: not recorded.
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

"""nvfp4_recipe/parts.py: the step profile's timers (issue 16, item 1)."""

from __future__ import annotations

import pytest
import torch

from nvfp4_recipe import NVFP4Config, quantized_linear
from nvfp4_recipe.parts import PartTimer, part


def test_innermost_label_owns_the_time_and_nothing_is_counted_twice(monkeypatch):
    import nvfp4_recipe.parts as parts

    clock = [0.0]
    monkeypatch.setattr(parts.time, "perf_counter", lambda: clock[0])

    def spend(seconds):
        clock[0] += seconds

    with PartTimer() as timer:
        with part("outer"):
            spend(2.0)
            with part("inner"):
                spend(3.0)
            with part("inner"):
                spend(1.0)
            spend(0.5)
    assert timer.calls == {"outer": 1, "inner": 2}
    assert dict(timer.seconds) == {"outer": 2.5, "inner": 4.0}  # the outer's own time only


def test_no_timer_no_record_and_one_timer_at_a_time():
    with part("nothing"):
        pass
    with PartTimer() as timer:
        with pytest.raises(RuntimeError, match="already active"):
            PartTimer().__enter__()
    assert dict(timer.seconds) == {}


def test_the_emulated_linear_labels_its_parts_forward_and_backward():
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(48, 64, dtype=torch.bfloat16, requires_grad=True)
    with PartTimer() as timer:
        quantized_linear(x, w, None, NVFP4Config()).float().sum().backward()
    # Fprop, Dgrad and Wgrad: three GEMMs; the two quantize regions of the backward and the
    # forward's one; SR draws for dY twice (Dgrad, Wgrad); two Wgrad transposes with the RHT.
    assert timer.calls == {"emulation/quantize": 3, "emulation/gemm": 3,
                           "emulation/sr_draws": 2, "emulation/wgrad_transpose_rht": 2}

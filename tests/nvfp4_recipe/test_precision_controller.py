"""The precision controller (nvfp4_recipe/megatron/controller.py): what the trainer calls around
each step, on a stand-in model (no megatron needed)."""

from types import SimpleNamespace

import pytest
import torch

from nvfp4_recipe.megatron.controller import (PrecisionController, diagnostics_summary,
                                              switch_due)
from nvfp4_recipe.policy import PrecisionConfig, RuntimePrecisionState, SwitchToBF16Config
from training.cadence import Every

TOKENS_PER_STEP, STEPS = 100, 10


class StandInLinear(torch.nn.Module):
    """What the controller sees of an emulated linear: the cache flag and the diagnostics."""

    def __init__(self):
        super().__init__()
        self.is_first_microbatch = None
        self.diagnostics = {}


def controller(diagnostics_due=lambda step: False, **precision) -> PrecisionController:
    cfg = PrecisionConfig(name="x", **{"format": "nvfp4", **precision})
    model = torch.nn.Module()
    model.decoder = torch.nn.Module()
    model.decoder.linear = StandInLinear()
    built = SimpleNamespace(module=model, policy=SimpleNamespace(first=1, last=1),
                            runtime_state=RuntimePrecisionState())
    return PrecisionController(cfg, built, TOKENS_PER_STEP, TOKENS_PER_STEP * STEPS,
                               diagnostics_due)


@pytest.mark.parametrize("fmt,at,consumed,due", [
    ("nvfp4", None, 1000, False), ("nvfp4", 0.5, 499, False), ("nvfp4", 0.5, 500, True),
    ("bf16", 0.5, 1000, False),  # nothing to switch
])
def test_switch_is_due_at_its_share_of_the_tokens(fmt, at, consumed, due):
    cfg = PrecisionConfig(format=fmt, switch_to_bf16=SwitchToBF16Config(at_fraction=at))
    assert switch_due(cfg, consumed, 1000) is due


def test_diagnostics_are_due_on_the_cadence_the_caller_gives():
    assert [s for s in range(1, 10) if Every(3)(s)] == [3, 6, 9]  # the trainer's Every
    assert not any(Every(0)(s) for s in range(1, 10))
    ctl = controller(diagnostics_due=Every(3))
    assert [s for s in range(9) if (ctl.before_step(s), ctl.state.collect_diagnostics)[1]] == \
        [2, 5, 8]  # optimizer steps 3, 6, 9
    ctl = controller()  # no cadence given (an evaluation): never
    assert not any((ctl.before_step(s), ctl.state.collect_diagnostics)[1] for s in range(9))


def test_the_switch_happens_once_and_is_reported_once():
    ctl = controller(switch_to_bf16=SwitchToBF16Config(at_fraction=0.3, passes="forward"))
    events = {step: ctl.before_step(step) for step in range(STEPS)}
    assert {s: e for s, e in events.items() if e} == {
        3: [("switch_to_bf16", {"passes": "forward", "consumed_tokens": 300})]}
    assert ctl.state.switched_passes == "forward"


def test_every_step_and_evaluation_refreshes_the_quantized_weights():
    ctl = controller()
    linear = ctl.model.decoder.linear
    for hook in (lambda: ctl.before_step(0), ctl.before_evaluation):
        linear.is_first_microbatch = False
        hook()
        assert linear.is_first_microbatch is True


def test_diagnostics_are_collected_on_due_steps_only_and_cleared():
    ctl = controller(diagnostics_due=Every(2))
    linear = ctl.model.decoder.linear
    ctl.before_step(0)  # step 1: not due
    assert not ctl.state.collect_diagnostics and ctl.after_step(0) == {}
    ctl.before_step(1)  # step 2: due; the linears record while the flag is on
    assert ctl.state.collect_diagnostics
    linear.diagnostics = {"weight": {"rel_error": 0.25, "zero_frac": 0.5}}
    metrics = ctl.after_step(1)
    assert metrics == {"quant/linear/weight/rel_error": 0.25, "quant/linear/weight/zero_frac": 0.5}
    assert not ctl.state.collect_diagnostics and linear.diagnostics == {}
    assert diagnostics_summary(metrics) == ("quant: 1 low-precision linears, relative error mean "
                                            "0.2500 max 0.2500, flushed-to-zero mean 0.5000")

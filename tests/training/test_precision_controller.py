"""The precision controller (training/precision.py): what the trainer calls around each step, on
stand-in linears (no megatron needed)."""

from types import SimpleNamespace

import pytest
import torch

from nvfp4_recipe.linear_protocol import HeldLinear, PrecisionLinear
from nvfp4_recipe.policy import PrecisionConfig, RuntimePrecisionState, SwitchToBF16Config
from training.cadence import Every
from training.precision import PrecisionController, diagnostics_summary, switch_due

TOKENS_PER_STEP, STEPS = 100, 10


class StandInLinear:
    """A PrecisionLinear that remembers what the controller asked of it."""

    def __init__(self):
        self.refreshed = 0
        self.diagnostics = {}
        self.input_amax = None

    def take_diagnostics(self):
        taken, self.diagnostics = self.diagnostics, {}
        return taken

    def record_input_amax(self, into):
        self.input_amax = into
        return True

    def refresh_weight_cache(self):
        self.refreshed += 1


def controller(diagnostics_due=lambda step: False, **precision) -> PrecisionController:
    cfg = PrecisionConfig(name="x", **{"format": "nvfp4", **precision})
    formats = {"layers.0.mlp.linear_fc1": "bf16", "layers.1.mlp.linear_fc1": "nvfp4"}
    built = SimpleNamespace(
        module=torch.nn.Linear(1, 1), runtime_state=RuntimePrecisionState(),
        policy=SimpleNamespace(first=1, last=0, linear_formats=lambda: formats),
        linears=[HeldLinear(name, fmt, StandInLinear()) for name, fmt in formats.items()])
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
    assert ctl.state.bf16_passes == ("fprop",)


def test_every_step_and_evaluation_refreshes_every_linears_weight_cache():
    """BF16 linears too: a TE linear's flag also decides how its fused Wgrad meets the main grad."""
    ctl = controller()
    ctl.before_step(0)
    ctl.before_evaluation()
    assert [held.linear.refreshed for held in ctl.linears] == [2, 2]


def test_the_low_precision_linears_record_their_input_amax():
    ctl = controller()
    bf16, nvfp4 = (held.linear for held in ctl.linears)
    assert bf16.input_amax is None and nvfp4.input_amax is not None
    assert ctl.input_amax.names == ["layers.1.mlp.linear_fc1"]
    nvfp4.input_amax.fill_(3.0)
    ctl.after_step(0)
    assert ctl.input_amax.history[0].tolist() == [3.0] and float(nvfp4.input_amax) == 0.0


def test_diagnostics_are_collected_on_due_steps_only_and_cleared():
    ctl = controller(diagnostics_due=Every(2))
    linear = ctl.linears[1].linear
    ctl.before_step(0)  # step 1: not due
    assert not ctl.state.collect_diagnostics and ctl.after_step(0) == {}
    ctl.before_step(1)  # step 2: due; the linears record while the flag is on
    assert ctl.state.collect_diagnostics
    linear.diagnostics = {"weight": {"rel_error": 0.25, "zero_frac": 0.5}}
    metrics = ctl.after_step(1)
    assert metrics == {"quant/layers.1.mlp.linear_fc1/weight/rel_error": 0.25,
                       "quant/layers.1.mlp.linear_fc1/weight/zero_frac": 0.5}
    assert not ctl.state.collect_diagnostics and linear.diagnostics == {}
    assert diagnostics_summary(metrics) == ("quant: 1 low-precision linears, relative error mean "
                                            "0.2500 max 0.2500, flushed-to-zero mean 0.5000")


def test_the_builder_hands_over_every_linear_of_the_policy(parallel_context):
    """The emulated model's linears, named and formatted as the policy names them (the names
    the input amax and the diagnostics are recorded under), each a PrecisionLinear."""
    from model.build import build_model
    from model.config import ModelConfig

    cfg = PrecisionConfig(name="nvfp4", format="nvfp4",
                          overrides={"layers.4.mlp.linear_fc2": "bf16"})
    built = build_model(ModelConfig(vocab_size=256), cfg, vocab_size=256, backend="emulated")
    assert {h.name: h.format for h in built.linears} == built.policy.linear_formats()
    assert [h.name for h in built.linears] == built.policy.names()  # pattern order
    decoder = built.module.decoder
    for held in built.linears:
        _, index, module = held.name.split(".", 2)
        assert held.linear is decoder.layers[int(index)].get_submodule(module)
        assert isinstance(held.linear, PrecisionLinear)

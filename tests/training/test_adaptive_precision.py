"""precision.adaptive (training/precision.py): the pure decision on telemetry windows, the
controller that applies it to stand-in linears and keeps it in checkpoints, the telemetry's metric
keys, and the settings refused before training (exit 2). The runs that train are in
tests/system/test_adaptive_runs.py."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from errors import ExitCode
from nvfp4_recipe.passes import PassFormats
from nvfp4_recipe.policy import (AdaptiveConfig, AdaptiveThresholds, PrecisionConfig,
                                 RuntimePrecisionState)
from nvfp4_recipe.linear_protocol import HeldLinear, PrecisionLinear
from nvfp4_recipe.telemetry import COUNTS
from training.precision import (FALLBACK_EVENT, AdaptiveState, PrecisionController, block_fits,
                                fallback_decisions, pass_statistics, parse_underflow_key,
                                precision_map_of, underflow_key)

A, B = "layers.1.mlp.linear_fc1", "layers.2.mixer.in_proj"
NVFP4 = PassFormats("nvfp4")


def adaptive(**fields) -> AdaptiveConfig:
    fields.setdefault("thresholds", AdaptiveThresholds(flush=0.5))
    return AdaptiveConfig(enabled=True, **{"patience": 2, "max_fallback_fraction": 1.0, **fields})


def windows(cfg: AdaptiveConfig, stats_per_window, formats=None, total=6, fits=None):
    """Run fallback_decisions over the windows, applying each decision to the formats as the
    controller does; returns ([decisions per window], final formats, final state)."""
    formats = dict(formats or {A: NVFP4, B: NVFP4})
    state, out = AdaptiveState(), []
    for stats in stats_per_window:
        state, decisions = fallback_decisions(stats, formats, state, cfg, total,
                                              fits or (lambda linear, fmt: True))
        for d in decisions:
            formats[d.module] = formats[d.module].replace({d.gemm: d.target})
        out.append([(d.module, d.gemm, d.source, d.target) for d in decisions])
    return out, formats, state


def test_underflow_keys_parse_back_and_other_keys_do_not():
    key = underflow_key(B, "wgrad", "dy", "scale_underflow")
    assert key == f"underflow/{B}/wgrad/dy/scale_underflow"
    assert parse_underflow_key(key) == (B, "wgrad", "dy", "scale_underflow")
    for other in (f"quant/{B}/activation/zero_frac", f"underflow/{B}/fprop/dy/flush",  # fprop has no dy
                  f"underflow/{B}/fprop/x/zero_frac", f"underflow/{B}/fprop/x", "loss"):
        assert parse_underflow_key(other) is None


def test_a_pass_moves_one_rung_after_patience_windows_above_and_starts_counting_again():
    high = {(A, "fprop"): {"flush": 0.9}}
    decided, formats, _ = windows(adaptive(), [high, high, high, high, high])
    assert decided == [[], [(A, "fprop", "nvfp4", "mxfp8")], [],
                       [(A, "fprop", "mxfp8", "bf16")], []]  # bf16 is the last rung
    assert formats[A] == "bf16/nvfp4/nvfp4" and formats[B] == "nvfp4"


def test_a_window_at_or_below_the_threshold_starts_the_count_again():
    at, high = {(A, "fprop"): {"flush": 0.5}}, {(A, "fprop"): {"flush": 0.6}}
    decided, _, _ = windows(adaptive(), [high, at, high, {}, high])
    # a window without the statistic (nothing measured) neither counts nor resets
    assert decided == [[], [], [], [], [(A, "fprop", "nvfp4", "mxfp8")]]


def test_forward_only_moves_fprop_and_all_moves_each_pass_on_its_own_statistics():
    stats = {(A, "dgrad"): {"flush": 0.9}, (A, "wgrad"): {"flush": 0.9}, (B, "fprop"): {"flush": 0.1}}
    decided, _, _ = windows(adaptive(passes="forward"), [stats, stats])
    assert decided == [[], []]
    decided, formats, _ = windows(adaptive(passes="all"), [stats, stats])
    assert decided[1] == [(A, "dgrad", "nvfp4", "mxfp8"), (A, "wgrad", "nvfp4", "mxfp8")]
    assert formats[A] == "nvfp4/mxfp8/mxfp8"


def test_the_cap_lets_the_furthest_above_their_thresholds_go_first_and_counts_a_gemm_once():
    stats = {(A, "fprop"): {"flush": 0.6}, (A, "dgrad"): {"flush": 0.95},
             (B, "fprop"): {"flush": 0.8}}
    # 4 quantized GEMMs, 50 %: two may ever move
    decided, formats, state = windows(adaptive(max_fallback_fraction=0.5),
                                      [stats] * 6, total=4)
    assert decided[1] == [(A, "dgrad", "nvfp4", "mxfp8"), (B, "fprop", "nvfp4", "mxfp8")]
    assert decided[3] == [(A, "dgrad", "mxfp8", "bf16"), (B, "fprop", "mxfp8", "bf16")]
    assert formats[A] == "nvfp4/bf16/nvfp4" and state.moved == {(A, "dgrad"), (B, "fprop")}


def test_each_statistic_has_its_own_threshold_and_the_event_names_the_one_that_decided():
    cfg = adaptive(thresholds=AdaptiveThresholds(flush=None, scale_underflow=0.2))
    stats = {(A, "fprop"): {"flush": 1.0, "scale_underflow": 0.5}}
    _, decisions = fallback_decisions(stats, {A: NVFP4}, AdaptiveState({(A, "fprop",
                                      "scale_underflow"): 1}), cfg, 3)
    assert [d.fields() for d in decisions] == [{
        "module": A, "pass": "fprop", "from": "nvfp4", "to": "mxfp8",
        "statistic": "scale_underflow", "value": 0.5, "threshold": 0.2, "windows": 2}]


def test_a_format_the_shapes_cannot_run_is_skipped_and_one_off_the_ladder_never_moves():
    fits = block_fits({"mlp.linear_fc1": (48, 64)})  # K = 48: no whole 32-blocks for MXFP8
    stats = {(A, "fprop"): {"flush": 0.9}, (B, "fprop"): {"flush": 0.9}}
    decided, _, _ = windows(adaptive(), [stats, stats], formats={A: NVFP4, B: PassFormats("fp8")},
                            fits=fits)
    assert decided == [[], [(A, "fprop", "nvfp4", "bf16")]]


def test_pass_statistics_take_the_largest_over_a_pass_operands():
    window = {underflow_key(A, "wgrad", "dy", "flush"): 0.2,
              underflow_key(A, "wgrad", "x", "flush"): 0.7,
              underflow_key(A, "wgrad", "x", "scale_underflow"): 0.1, "loss": 3.0}
    assert pass_statistics(window) == {(A, "wgrad"): {"flush": 0.7, "scale_underflow": 0.1}}


# -- the controller ---------------------------------------------------------------------------


class StandInLinear:
    """A PrecisionLinear whose telemetry the test sets and which remembers its formats."""

    def __init__(self):
        self.counts, self.formats, self.configs = {}, None, None

    def take_diagnostics(self):
        return {}

    def record_input_amax(self, into):
        return False

    def refresh_weight_cache(self):
        pass

    def take_telemetry(self):
        taken, self.counts = self.counts, {}
        return taken

    def set_formats(self, formats, gemm_config):
        self.formats, self.configs = formats, gemm_config


def controller(**adaptive_fields) -> PrecisionController:
    cfg = PrecisionConfig(name="x", format="nvfp4", adaptive=adaptive(**adaptive_fields))
    formats = {"layers.0.mlp.linear_fc1": "bf16", A: "nvfp4", B: "nvfp4"}
    built = SimpleNamespace(
        module=torch.nn.Linear(1, 1), runtime_state=RuntimePrecisionState(),
        policy=SimpleNamespace(linear_formats=lambda: formats),
        linears=[HeldLinear(name, fmt, StandInLinear()) for name, fmt in formats.items()])
    return PrecisionController(cfg, built, 100, 1000, telemetry_due=lambda step: True)


def flushing(fraction: float) -> torch.Tensor:
    """COUNTS of an operand of 1000 nonzero values, `fraction` of them flushed, 10 blocks."""
    return torch.tensor([round(1000 * fraction), 1000, 0, 10, 0, 10])


def step(ctl: PrecisionController, step: int, flush_b: float):
    ctl.before_step(step)
    for held in ctl.linears:
        if held.name == B:
            held.linear.counts = {"fprop/x": flushing(flush_b), "fprop/w": flushing(0.0)}
    metrics = ctl.after_step(step)
    return metrics, ctl.decide(step + 1)


def test_the_controller_logs_the_reduced_statistics_decides_and_switches_the_linear():
    assert isinstance(StandInLinear(), PrecisionLinear) and len(COUNTS) == 6
    ctl = controller()
    metrics, events = step(ctl, 0, 0.75)
    assert metrics[underflow_key(B, "fprop", "x", "flush")] == 0.75
    assert metrics[underflow_key(B, "fprop", "w", "flush")] == 0.0
    # measured nowhere (a stand-in reports only B's fprop): left out, not logged as 0
    assert not any(k.startswith(f"underflow/{A}/") for k in metrics) and events == []
    _, events = step(ctl, 1, 0.75)
    assert events == [(FALLBACK_EVENT, {"module": B, "pass": "fprop", "from": "nvfp4",
                                        "to": "mxfp8", "statistic": "flush", "value": 0.75,
                                        "threshold": 0.5, "windows": 2})]
    linear = {h.name: h.linear for h in ctl.linears}[B]
    assert linear.formats == "mxfp8/nvfp4/nvfp4"
    assert type(linear.configs.fprop).__name__ == "MXFP8Config"
    assert type(linear.configs.dgrad).__name__ == "NVFP4Config"
    assert ctl.switched_formats() == {B: "mxfp8/nvfp4/nvfp4"}
    assert ctl.state.linear_formats == {B: "mxfp8/nvfp4/nvfp4"}  # what the TE contexts read


def test_a_restored_controller_decides_as_the_uninterrupted_one():
    whole, parts = controller(patience=3), controller(patience=3)
    flushes = [0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9]
    uninterrupted = [step(whole, s, f)[1] for s, f in enumerate(flushes)]
    resumed = [step(parts, s, f)[1] for s, f in enumerate(flushes[:4])]
    saved = parts.state_dict()
    assert precision_map_of({"precision": saved}) == {B: PassFormats("mxfp8/nvfp4/nvfp4")}
    restored = controller(patience=3)
    restored.load_state_dict(saved)
    resumed += [step(restored, s, f)[1] for s, f in enumerate(flushes[4:], start=4)]
    assert resumed == uninterrupted and sum(map(len, resumed)) == 2  # nvfp4 -> mxfp8 -> bf16
    assert restored.switched_formats() == whole.switched_formats() == {B: "bf16/nvfp4/nvfp4"}


def test_the_map_freezes_after_its_step_and_the_policys_formats_undo_a_switch():
    ctl = controller(freeze_after_step=1)
    assert [step(ctl, s, 0.9)[1] for s in range(4)] == [[], [], [], []]  # 2 windows only at 2
    ctl.apply_formats({B: "mxfp8"})
    assert ctl.switched_formats() == {B: "mxfp8"}
    ctl.apply_formats({B: "nvfp4"})
    assert ctl.switched_formats() == {} and ctl.state_dict()["map"] == {}
    with pytest.raises(ValueError, match="layers.9.mlp.linear_fc1"):
        ctl.apply_formats({"layers.9.mlp.linear_fc1": "bf16"})


# -- refusals --------------------------------------------------------------------------------


@pytest.mark.parametrize("override,message", [
    ("precision.adaptive.thresholds.flush=1.5",
     "precision.adaptive.thresholds.flush=1.5: a fraction in [0, 1], or null for not watched"),
    ("precision.adaptive.thresholds.scale_underflow=-0.1",
     "precision.adaptive.thresholds.scale_underflow=-0.1: a fraction in [0, 1]"),
    ("precision.adaptive.ladder=[nvfp4,mxfp9,bf16]",
     "precision.adaptive.ladder names 'mxfp9', not a format: choose from bf16, nvfp4, fp8, "
     "mxfp4, mxfp8"),
    ("precision.adaptive.ladder=[nvfp4]", "precision.adaptive.ladder=['nvfp4']: two or more"),
    ("precision.adaptive.patience=0", "precision.adaptive.patience=0 must be >= 1"),
    ("precision.adaptive.max_fallback_fraction=1.2",
     "precision.adaptive.max_fallback_fraction=1.2: a fraction of the quantized GEMMs in [0, 1]"),
    ("precision.adaptive.freeze_after_step=-1",
     "precision.adaptive.freeze_after_step=-1 must be >= 0"),
    ("precision.telemetry.rows=0", "precision.telemetry.rows=0 must be >= 1"),
])
def test_bad_adaptive_settings_stop_the_start_up_with_exit_2(tmp_path, demo_corpus, caplog,
                                                             override, message):
    from hydra import compose, initialize_config_dir

    from train_helpers import FAST, RECIPES
    from training import entry
    from training.config import register_configs

    register_configs()
    with initialize_config_dir(str(RECIPES), version_base=None):
        raw = compose("train", overrides=[*FAST, "precision=nvfp4", f"run.dir={tmp_path / 'run'}",
                                          f"data.cache_dir={demo_corpus[0]}", override])
    with caplog.at_level(logging.ERROR, logger="nvfp4_pretrain"):
        assert entry.run(raw) == ExitCode.CONFIG
    assert message in caplog.text
    assert not (tmp_path / "run").exists()


def test_adaptive_without_telemetry_is_refused():
    with pytest.raises(ValueError, match=r"^precision.adaptive.enabled=true needs the telemetry"):
        PrecisionConfig(format="nvfp4", adaptive=AdaptiveConfig(enabled=True),
                        telemetry=type(PrecisionConfig().telemetry)(every=0))

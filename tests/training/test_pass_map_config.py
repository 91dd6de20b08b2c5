"""A format per GEMM pass from the command line, as train.py composes it: for the whole model
(`precision.format`) and per module (`precision.overrides`); a bad format or pass name stops
the start-up with exit 2, naming the allowed values."""

from __future__ import annotations

import logging

import pytest

from errors import ExitCode
from model.config import precision_policy
from train_helpers import FAST, compose_train


def test_an_override_map_from_the_command_line():
    cfg = compose_train("precision=nvfp4",
                        "precision.overrides={layers.*.mixer.out_proj: {forward: mxfp8, backward: nvfp4}}")
    assert cfg.precision.overrides == {"layers.*.mixer.out_proj": {"forward": "mxfp8",
                                                                   "backward": "nvfp4"}}
    formats = precision_policy(cfg.model, cfg.precision).linear_formats()
    # demo M-M*-M-M-: Mamba layers 0, 2, 5, 7; the first 1 / last 2 layers BF16 (the map names
    # every pass, so it holds there too).
    assert {n: str(f) for n, f in formats.items() if n.endswith("out_proj")} == {
        f"layers.{i}.mixer.out_proj": "mxfp8/nvfp4/nvfp4" for i in (0, 2, 5, 7)}
    assert formats["layers.2.mixer.in_proj"] == "nvfp4"


def test_a_format_map_for_the_whole_model_from_the_command_line():
    cfg = compose_train("precision.format={forward: mxfp8, backward: bf16}")
    assert cfg.precision.format == {"forward": "mxfp8", "backward": "bf16"}
    policy = precision_policy(cfg.model, cfg.precision)
    # precision=bf16 sets no BF16 layers of its own: the model's (demo: first 1, last 2).
    assert [str(d.format) for d in policy.layers()] == [
        "bf16", *["mxfp8/bf16/bf16"] * 6, "bf16", "bf16"]
    assert policy.recipe()["format"] == "mxfp8/bf16/bf16"


@pytest.mark.parametrize("override,message", [
    ("precision.format={upward: mxfp8}",
     "precision.format: 'upward' is not a GEMM pass; use fprop, dgrad, wgrad, forward (= fprop), "
     "backward (= dgrad + wgrad)"),
    ("precision.format=mxfp9",
     "precision.format='mxfp9': choose one of bf16, nvfp4, fp8, mxfp4, mxfp8"),
    ("++precision.overrides={layers.*.mixer.out_proj: {forward: mxfp9}}",
     "precision.overrides['layers.*.mixer.out_proj'].forward='mxfp9': choose one of bf16, nvfp4, "
     "fp8, mxfp4, mxfp8"),
    ("++precision.overrides={layers.*.mixer.out_proj: {fprop: nvfp4, forward: mxfp8}}",
     "'fprop' and 'forward' both name fprop"),
])
def test_a_bad_format_or_pass_stops_the_start_up_with_exit_2(tmp_path, demo_corpus, caplog,
                                                             override, message):
    from hydra import compose, initialize_config_dir

    from train_helpers import RECIPES
    from training import entry
    from training.config import register_configs

    register_configs()
    with initialize_config_dir(str(RECIPES), version_base=None):
        raw = compose("train", overrides=[*FAST, f"run.dir={tmp_path / 'run'}",
                                          f"data.cache_dir={demo_corpus[0]}", override])
    with caplog.at_level(logging.ERROR, logger="nvfp4_pretrain"):
        assert entry.run(raw) == ExitCode.CONFIG
    assert message in caplog.text
    assert not (tmp_path / "run").exists()

"""benchmarks/moe_step.py: the dense twin carries demo_moe's active parameters, every MoE part
names a function the timer can wrap and is counted once per MoE layer, and the report's ratio is
against the twin."""

from __future__ import annotations

import pytest
import torch

from benchmarks import moe_step
from benchmarks.part_timer import PartTimer
from model.build import build_model
from nvfp4_recipe.policy import PrecisionConfig


def _active(name: str) -> tuple[int, int]:
    cfg = moe_step.model_config(name)
    torch.manual_seed(0)
    module = build_model(cfg, PrecisionConfig(), vocab_size=cfg.vocab_size,
                         backend="emulated").module
    routers = sum(p.numel() for n, p in module.named_parameters() if ".mlp.router." in n)
    return moe_step.active_parameters(cfg, module), routers


def test_the_dense_twin_passes_a_token_through_as_many_weights_as_demo_moe(parallel_context):
    moe = moe_step.model_config("demo_moe")
    dense = moe_step.model_config("dense_same_active")
    assert dense.pattern == moe.pattern.replace("E", "-") and dense.moe is None
    assert dense.ffn_hidden_size == 2 * 256 + 256  # top-2 of width 256, one shared of 256
    (moe_active, routers), (dense_active, _) = _active("demo_moe"), _active("dense_same_active")
    # The routers' weights (8 experts x 256 per MoE layer) are the only difference.
    assert routers == moe.pattern.count("E") * 8 * 256
    assert moe_active - dense_active == routers


def test_every_moe_part_is_timed_once_per_layer_and_put_back(parallel_context):
    from megatron.core.transformer.moe.router import TopKRouter

    original = vars(TopKRouter)["forward"]
    cfg = moe_step.model_config("demo_moe")
    torch.manual_seed(0)
    module = build_model(cfg, PrecisionConfig(), vocab_size=cfg.vocab_size,
                         backend="emulated").module
    tokens = torch.randint(0, cfg.vocab_size, (2, 64))
    position_ids = torch.arange(64).expand(2, 64)
    with PartTimer(moe_step.moe_parts()) as timer, torch.no_grad():
        module(tokens, position_ids, None)
    seconds, calls = timer.take()
    layers = cfg.pattern.count("E")
    assert calls == {moe_step.ROUTER: layers, moe_step.DISPATCH: 6 * layers,
                     moe_step.EXPERTS: layers, moe_step.SHARED: layers}
    assert all(s > 0 for s in seconds.values())
    assert vars(TopKRouter)["forward"] is original


def test_the_report_compares_each_model_with_the_dense_twin_of_its_precision():
    parts = {moe_step.ROUTER: 0.01, moe_step.DISPATCH: 0.02, moe_step.EXPERTS: 0.1,
             moe_step.SHARED: 0.03, moe_step.FFN_FORWARD: 0.2, moe_step.FFN_BACKWARD: 0.3,
             moe_step.OPTIMIZER: 0.05}
    result = {"cases": [
        {"model": "demo_moe", "precision": "bf16", "parameters": 8e6, "active": 5e6,
         "step_s": 1.0, "tokens_per_s": 2048.0, "parts_s": parts},
        {"model": "dense_same_active", "precision": "bf16", "parameters": 5e6, "active": 5e6,
         "step_s": 0.8, "tokens_per_s": 2560.0, "parts_s": {}},
    ], "gemm_compute": "BF16", "load_line": "idle", "loaded": False, "steps": 2, "repeats": 3}
    text = moe_step.report(result)
    assert "| demo_moe | bf16 | 8.00M | 5.00M | 1000 ms | 2,048 | 0.80x |" in text
    assert "| dense_same_active | bf16 | 5.00M | 5.00M | 800 ms | 2,560 | 1.00x |" in text
    assert "| moe/dispatch | 20 ms (2.0 %) |" in text
    # the step less the feed-forward layers and the optimizer is the rest
    assert "| demo_moe | bf16 | 1000 ms | 200 ms | 300 ms | 50 ms | 450 ms |" in text
    assert "| dense_same_active | bf16 | 800 ms | 0 ms | 0 ms | 0 ms | 800 ms |" in text


def test_unknown_models_and_precisions_are_refused(capsys):
    with pytest.raises(SystemExit) as err:
        moe_step.main(["--models", "demo_moe,huge"])
    assert err.value.code == 2
    assert "unknown ['huge']" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["demo_moe", "dense_same_active"])
def test_the_feed_forward_layers_are_timed_once_each_way(parallel_context, name):
    """Each feed-forward layer (MoE or MLP) adds one forward and one backward interval, and a
    backward interval spans that layer's own backward: a 200 ms pause injected into the backward
    of one layer's fc2 lands in that layer's interval (the longest: the others are a few ms of
    128 tokens), and the intervals together fit in the backward's wall time."""
    import time

    cfg = moe_step.model_config(name)
    torch.manual_seed(0)
    module = build_model(cfg, PrecisionConfig(), vocab_size=cfg.vocab_size,
                         backend="emulated").module
    intervals = []

    class Counting(dict):  # records every interval the hooks add, by label
        def __missing__(self, key):
            return 0.0

        def __setitem__(self, key, value):
            intervals.append((key, value - self.get(key, 0.0)))
            super().__setitem__(key, value)

    handles = moe_step.time_ffn_layers(module, Counting())
    layers = [i for i, kind in enumerate(cfg.pattern) if kind in "E-"]
    assert len(layers) == 4 and len(handles) == 4 * len(layers)
    ffn = module.decoder.layers[layers[1]].mlp
    fc2 = ffn.shared_experts.linear_fc2 if name == "demo_moe" else ffn.linear_fc2
    handles.append(fc2.register_full_backward_hook(lambda *_: time.sleep(0.2)))
    tokens = torch.randint(0, cfg.vocab_size, (2, 64))
    loss = module(tokens, torch.arange(64).expand(2, 64), None, labels=tokens).float().mean()
    assert [k for k, _ in intervals] == [moe_step.FFN_FORWARD] * len(layers)
    intervals.clear()
    start = time.perf_counter()
    loss.backward()
    wall = time.perf_counter() - start
    assert [k for k, _ in intervals] == [moe_step.FFN_BACKWARD] * len(layers)
    by_layer = dict(zip(reversed(layers), (t for _, t in intervals)))  # the last layer first
    assert by_layer[layers[1]] >= 0.2 and max(by_layer, key=by_layer.get) == layers[1]
    assert sum(by_layer.values()) <= wall
    for handle in handles:
        handle.remove()

"""train.py with a format per GEMM pass from the command line, on the Nemotron 3 recipe: the run
trains, logs each linear's Fprop/Dgrad/Wgrad formats, and measures the mixed linears (the
policy, the emulated GEMMs and the refusals in-process: tests/nvfp4_recipe/test_passes.py,
test_linear_passes.py, tests/training/test_pass_map_config.py, test_nemotron3_recipe.py)."""

from __future__ import annotations

import math

from train_helpers import FAST, run_train, step_losses

from training.metrics import read_metrics


def test_nemotron3_with_a_per_pass_override_trains_and_logs_its_map(tmp_path, data_cache):
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, *FAST, "trainer.max_steps=3", "trainer.eval_every=100",
                     "trainer.save_every=100", "precision=nvfp4_nemotron3",
                     "precision.overrides={layers.*.mlp.linear_fc2: {forward: mxfp8}}",
                     "precision.diagnostics_every=1", cache_dir=data_cache, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (run_dir / "train.log").read_text()
    # demo M-M*-M-M-: the last 2 layers BF16 (ceil(0.15 x 9)), attention BF16, out_proj MXFP8,
    # fc2 an MXFP8 Fprop over the layer's NVFP4 Dgrad and Wgrad (not in the BF16 end layers).
    assert ("mixer.in_proj: nvfp4 at 0-5; bf16 at 7 | mixer.out_proj: mxfp8 at 0-5; bf16 at 7 | "
            "mlp.linear_fc1: nvfp4 at 1-6; bf16 at 8 | mlp.linear_fc2: mxfp8/nvfp4/nvfp4 at 1-6; "
            "bf16 at 8 | self_attention.linear_qkv: bf16 at 3 | self_attention.linear_proj: "
            "bf16 at 3") in log
    losses = step_losses(run_dir)
    assert all(math.isfinite(v) for v in losses.values()) and losses[3] < losses[1]
    step1 = next(m for m in read_metrics(run_dir) if m.get("step") == 1 and "loss" in m)
    # The mixed linear's activation is measured as Fprop quantizes it (MXFP8, E4M3: measured
    # 0.027), its gradient as Dgrad does (NVFP4 with stochastic rounding: measured 0.137).
    assert step1["quant/layers.1.mlp.linear_fc2/activation/rel_error"] < 0.05
    assert step1["quant/layers.1.mlp.linear_fc2/gradient/rel_error"] > 0.08

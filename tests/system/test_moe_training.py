"""train.py with model=demo_moe: an NVFP4 hybrid MoE trains (emulated NVFP4 experts), and each step's
metrics carry the expert load of every MoE layer, with the console's expert-load line at each
validation; the expert bias moves with the load (aux-loss-free balancing) and a checkpoint resumes."""

from __future__ import annotations

from train_helpers import FAST, run_train
from training.metrics import read_metrics

MOE_LAYERS = (1, 4, 6, 8)  # demo_moe's 'MEM*EMEME'


def test_demo_moe_trains_in_nvfp4_and_reports_expert_load(tmp_path, data_cache):
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, *FAST, "model=demo_moe", "precision=nvfp4", "trainer.max_steps=8",
                     "trainer.eval_every=4", "trainer.save_every=4", cache_dir=data_cache,
                     timeout=1500)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = [m for m in read_metrics(run_dir) if "loss" in m]
    assert [m["step"] for m in steps] == list(range(1, 9))
    # From ln(vocab) ~ 8.3 (measured on the 2-core Xeon: 8.38 at step 1, ~7.1 by step 8).
    assert steps[0]["loss"] > 8.0 and steps[-1]["loss"] < steps[0]["loss"] - 0.7
    for m in steps:
        for i in MOE_LAYERS:
            tokens = [m[f"moe/{i}/tokens/{e}"] for e in range(8)]
            # 2 micro-batches x 2 sequences x 128 tokens, each at its top-2 experts
            assert sum(tokens) == 2 * 2 * 128 * 2
            assert m[f"moe/{i}/max_over_mean"] == max(tokens) / (sum(tokens) / 8)
            assert m[f"moe/{i}/aux_loss"] > 0
    # The bias moves by the update rate (1e-3) once per step, down where the load was high.
    last = steps[-1]
    # (8 steps of 1e-3 summed in FP32 land within float32 rounding of 8e-3, either side)
    bound = 8e-3 * (1 + 1e-6)
    assert 0 < last["moe/1/expert_bias_max"] <= bound and -bound <= last["moe/1/expert_bias_min"] < 0
    assert sum(line.startswith("expert load: max/mean ") for line in proc.stdout.splitlines()) == 2
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "step_0000004", "step_0000008"]

    # The run exports to transformers' NemotronH (one tensor per routed expert, as NVIDIA's
    # checkpoints store them), which loads it and generates; and to vLLM's NVFP4
    # (compressed-tensors), each routed expert its own module.
    import torch
    from transformers import AutoModelForCausalLM

    from hf_helpers import load_safetensors
    from model import hf
    from tools import hf_export
    from training import run_reader

    out = tmp_path / "hf"
    hf_export.export(run_dir, out)
    full = run_reader.read_checkpoint_weights(run_dir / "checkpoints" / "step_0000008")
    cfg = run_reader.read_run(run_dir).model
    expected = {k.replace("model.", "backbone.", 1): v
                for k, v in hf.split_experts(hf.to_hf(full, cfg, 4096)).items()}
    written = load_safetensors(out)
    assert "backbone.layers.8.mixer.experts.7.down_proj.weight" in written
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[k], v) for k, v in expected.items())
    model = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[1, 2, 3, 4]])
    assert model.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, 8)
    assert hf_export.main([str(run_dir), "--output", str(tmp_path / "served"),
                           "--weights", "nvfp4"]) == 0
    served = load_safetensors(tmp_path / "served")
    for suffix, dtype in (("weight_packed", torch.uint8), ("weight_scale", torch.float8_e4m3fn),
                          ("weight_global_scale", torch.float32),
                          ("input_global_scale", torch.float32)):
        assert served[f"backbone.layers.4.mixer.experts.5.up_proj.{suffix}"].dtype == dtype

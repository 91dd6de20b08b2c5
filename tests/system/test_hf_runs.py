"""Hugging Face round trips around train.py runs, as a user runs them (model/hf.py,
model/hf_nvfp4.py, tools/hf_export.py): a demo run exported, loaded in transformers and generating;
model.init_from at TP=1 and TP=2, exported bit-identical; train.py refusing an init_from that does
not fit with one line, writing nothing; a TP=2 NVFP4 run recording its input amax, resumed and
exported in both serving formats (the conversions in one process: tests/model/test_hf.py,
tests/model/test_hf_nvfp4.py)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers", reason="the Hugging Face extra: pip install -e '.[hf]'")

from hf_helpers import (load_safetensors, random_hf_dir, rewrite_tensors, saved_key,  # noqa: E402
                        truncate)
from train_helpers import FAST, REPO, RESUMABLE, run_train, step_losses  # noqa: E402

from errors import ExitCode  # noqa: E402
from model import hf, hf_nvfp4  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from nvfp4_recipe.megatron.input_amax import running_input_amax  # noqa: E402
from nvfp4_recipe.nvfp4 import nvfp4_scaled_values, quantize_nvfp4  # noqa: E402
from tools import hf_export  # noqa: E402
from training import run_reader  # noqa: E402


TRAIN = [*FAST, "precision=bf16", "trainer.max_steps=2", "trainer.save_every=2",
         "trainer.eval_every=100"]


def _export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.hf_export", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)


def test_demo_run_exports_loads_in_transformers_and_generates(tmp_path, shared_runs, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, _ = shared_runs.get(*RESUMABLE)  # BF16, checkpoints at steps 2 and 4
    out = tmp_path / "hf"
    proc = _export(run_dir, "--output", out, "--max-shard-size", "4MB")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (out / "model.safetensors.index.json").is_file()  # 12.5 MB of weights in shards
    for name in ("config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json"):
        assert (out / name).is_file(), name

    # The exported tensors are the checkpoint's, split and stripped as documented.
    full = run_reader.read_checkpoint_weights(run_dir / "checkpoints" / "step_0000004")
    cfg = run_reader.read_run(run_dir).model
    expected = {k.replace("model.", "backbone.", 1): v
                for k, v in hf.to_hf(full, cfg, 4096).items()}
    written = load_safetensors(out)
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[k], v) for k, v in expected.items())

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    ids = tok("def main():", return_tensors="pt")
    generated = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert generated.shape[1] == ids["input_ids"].shape[1] + 8
    assert isinstance(tok.decode(generated[0]), str)

    # An existing output is never replaced without --overwrite (the CLI in this process: the
    # same main() as above, without another interpreter start).
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert hf_export.main([str(run_dir), "--output", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert hf_export.main([str(run_dir), "--output", str(out), "--overwrite",
                    "--step", "2"]) == 0
    assert not (out / "model.safetensors.index.json").exists()  # one 5GB-limit file now
    assert load_safetensors(out).keys() == expected.keys()
    assert not list(tmp_path.glob(".*.tmp-*")) and not list(tmp_path.glob(".*.old-*"))
    assert hf_export.main([str(run_dir), "--output", str(tmp_path / "other"),
                    "--step", "7"]) == 2
    assert "step_0000007" in capsys.readouterr().err and not (tmp_path / "other").exists()


def test_init_from_at_tp1_and_tp2_then_export_is_bit_identical(tmp_path, data_cache):
    """HF -> project (train.py, model.init_from) at TP=1 and TP=2 -> checkpoint -> HF.

    lr = 1e-30 keeps every weight bit-identical through the one optimizer step (Adam moves a
    weight by ~lr, far below half an FP32 ulp of any weight here; the decay factor 1 - lr x wd
    rounds to 1), so the round trip and the TP=2 == TP=1 exports can be compared exactly."""
    demo = ModelConfig()  # recipes/model/demo.yaml's shapes; the demo tokenizer has 4096 tokens
    hf_dir, original = random_hf_dir(tmp_path, demo, 4096)
    frozen = [*FAST, "precision=bf16", "trainer.max_steps=1", "trainer.save_every=1",
              "trainer.lr=1e-30", "trainer.min_lr=0", f"model.init_from={hf_dir}"]
    exported = {}
    for name, extra, nproc in (("tp1", [], 1), ("tp2", ["parallel.tensor=2"], 2)):
        run_dir = tmp_path / name
        proc = run_train(run_dir, *frozen, *extra, nproc=nproc, cache_dir=data_cache)
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, log
        assert "model.init_from: loaded" in log, log
        hf_export.export(run_dir, tmp_path / f"{name}_hf")
        exported[name] = load_safetensors(tmp_path / f"{name}_hf")
    want = {k.replace("model.", "backbone.", 1): v for k, v in original.items()}
    for name, tensors in exported.items():
        assert tensors.keys() == want.keys(), name
        for key, tensor in want.items():
            assert torch.equal(tensors[key], tensor), (name, key)

    # The first checkpoint is an ordinary one: the TP=2 run resumes at TP=1 (resharded), and
    # its step 2 is the TP=1 run's step 2 exactly: the same weights bit for bit (lr 1e-30), the
    # same batch, the same one-process computation. A resharding that misplaced any weight
    # would change the loss.
    losses = {}
    for name in ("tp1", "tp2"):
        proc = run_train(tmp_path / name, *frozen, "trainer.max_steps=2", cache_dir=data_cache)
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, log
        assert "resumed from" in log
        assert ("resharded from tensor 2" in log) == (name == "tp2"), log
        losses[name] = step_losses(tmp_path / name)
    assert losses["tp1"][2] == losses["tp2"][2], losses
    # The HF model was random: step 2's loss is near ln(4096) = 8.3, far from 0 or a NaN.
    assert 7.0 < losses["tp1"][2] < 10.0, losses


def test_train_py_refuses_a_truncated_init_from_with_one_line_writing_nothing(tmp_path, data_cache):
    hf_dir, _ = random_hf_dir(tmp_path, ModelConfig(), 4096)
    truncate(hf_dir / "model.safetensors", keep=0.9)
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, *TRAIN, f"model.init_from={hf_dir}", cache_dir=data_cache)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 2, log
    errors = [line for line in log.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "model.safetensors is truncated or corrupt" in errors[0], log
    assert "Traceback" not in log and not run_dir.exists()


def test_train_py_refuses_an_init_from_missing_a_tensor_writing_nothing(tmp_path, data_cache):
    hf_dir, _ = random_hf_dir(tmp_path, ModelConfig(), 4096)
    rewrite_tensors(hf_dir, lambda t: t.pop("backbone.layers.1.mixer.down_proj.weight"))
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, *TRAIN, f"model.init_from={hf_dir}", cache_dir=data_cache)
    log = proc.stdout + proc.stderr
    assert proc.returncode == ExitCode.CONFIG, log
    assert "no model.layers.1.mixer.down_proj.weight" in log and "Traceback" not in log
    assert not run_dir.exists()


def test_train_py_refuses_a_mismatched_init_from_writing_nothing(tmp_path, data_cache):
    hf_dir, _ = random_hf_dir(tmp_path, dataclasses.replace(ModelConfig(), hidden_size=128), 4096)
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, *TRAIN, f"model.init_from={hf_dir}", cache_dir=data_cache)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 2, log
    assert "model.hidden_size=256 but hidden_size=128" in log and "Traceback" not in log
    assert not run_dir.exists()


def test_a_tp2_nvfp4_run_records_amax_resumes_it_and_exports_both_formats(tmp_path, data_cache):
    """A TP=2 NVFP4 demo run records the input amax of every NVFP4 linear (the row-parallel
    ones all-reduced over their K-slices), keeps the window across a resume, and exports in
    both formats; the packed codes and scales are the project's quantization of the checkpoint's
    full weights (what a TP=1 forward computes: the TP=2 forward quantized each shard with its
    own tensor scale, which no serving format can hold — docs/serving.md)."""
    run_dir = tmp_path / "run"
    args = [*FAST, "precision=nvfp4", "trainer.max_steps=2", "trainer.save_every=1",
            "trainer.eval_every=100", "parallel.tensor=2"]
    proc = run_train(run_dir, *args, nproc=2, cache_dir=data_cache)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = run_reader.read_run(run_dir)
    formats = hf_export.serving_formats(files, "nvfp4")
    step1 = torch.load(run_dir / "checkpoints" / "step_0000001" / "trainer.pt", weights_only=True)
    step2 = run_dir / "checkpoints" / "step_0000002"
    amax, steps = running_input_amax(torch.load(step2 / "trainer.pt",
                                                weights_only=True)["input_amax"])
    assert steps == 2 and set(amax) == {k for k, f in formats.items() if f == "nvfp4"}
    assert all(v > 0 for v in amax.values())
    assert running_input_amax(step1["input_amax"])[1] == 1
    # Resumed at TP=1 for one more step: the window goes on (3 rows), every linear recorded.
    proc = run_train(run_dir, *args[:-1], "trainer.max_steps=3", cache_dir=data_cache)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    state = torch.load(run_dir / "checkpoints" / "step_0000003" / "trainer.pt", weights_only=True)
    assert running_input_amax(state["input_amax"])[1] == 3

    full = run_reader.read_checkpoint_weights(step2)
    packed = hf_nvfp4.packed_linears(full, files.model, formats, weight_2d=True)
    for fmt in hf_nvfp4.FORMATS:
        out = tmp_path / fmt
        hf_export.export(run_dir, out, step=2, weights="nvfp4", fmt=fmt)
        tensors = load_safetensors(out)
        code = "weight_packed" if fmt == "compressed-tensors" else "weight"
        for module, p in packed.items():
            assert torch.equal(tensors[f"{saved_key(module)}.{code}"], p.packed), (fmt, module)
            assert torch.equal(tensors[f"{saved_key(module)}.weight_scale"].view(torch.uint8),
                               p.scales.view(torch.uint8)), (fmt, module)
    # The codes are the Fprop operand: q * s of nvfp4_scaled_values on the full BF16 weight.
    key = next(k for k, f in formats.items() if f == "nvfp4")
    _, index, name = key.split(".", 2)
    w = hf_nvfp4.megatron_weight(full, files.model, int(index), name)
    values, _ = nvfp4_scaled_values(w.to(torch.bfloat16), 16, dtype=torch.float32,
                                    kernels="eager")
    first = packed[f"model.layers.{index}.{hf_nvfp4.HF_MODULES[name][0]}"]
    q = quantize_nvfp4(w.to(torch.bfloat16), (16, 16), kernels="eager")
    assert torch.equal(q.data[: first.packed.shape[0]], first.packed)
    from nvfp4_recipe.formats import decode_e2m1

    n, k = values.shape
    q_times_s = decode_e2m1(q.codes()).view(n, k // 16, 16) * q.scales.float().unsqueeze(-1)
    assert torch.equal(q_times_s.view(n, k), values)

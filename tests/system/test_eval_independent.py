"""The downstream evaluation checked from outside, by code it does not share: on a demo checkpoint,
`python -m tools.evaluate` gives lm-eval's own HFLM's per-sample log-likelihoods and accuracy
on the `tools.hf_export` of the same checkpoint, and the same scores at TP=2 and at PP=2.

One demo run (the test size, 2 steps, precision.gemm_compute=fp32 so both sides multiply in
FP32) serves every test here; the evaluations run as a user runs them, from the command line
(torchrun for the two-process layouts), with lm-eval's per-sample records (--log-samples).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from train_helpers import FAST, REPO, run_train

pytest.importorskip("lm_eval")

TASK = "demo_arith_choice"  # 4 choices per question: lm-eval's multiple_choice, acc/acc_norm
LIMIT = 16
TRAIN = [*FAST, "model.hidden_size=64", "model.ffn_hidden_size=128", "precision=bf16",
         "precision.gemm_compute=fp32", "trainer.max_steps=2", "trainer.save_every=2",
         "trainer.eval_every=100"]
# |project - HFLM| per request (a sum of ~-25 nats over its choice's tokens). The project runs
# the checkpoint's BF16 weights with BF16 activations and FP32 GEMMs whose outputs are rounded to
# BF16; HFLM runs the same BF16 weights in FP32 throughout. What differs is the project's BF16
# rounding of each activation (2^-9 relative): measured at most 3.5e-3 nats (transformers
# 5.24, lm-eval 0.4.13, torch 2.13 CPU). Tolerance 4x that. TP=2 rounds each shard's partial
# GEMM output to BF16 before the all-reduce: measured 3.1e-3 against TP=1, the same tolerance.
LOGLIK_TOL = 1.5e-2
# PP=2 splits the same arithmetic at a stage boundary whose activations are BF16 on both sides:
# measured identical to TP=1; a summation-order allowance only.
PP_TOL = 1e-4


@pytest.fixture(scope="module")
def run(tmp_path_factory, data_cache) -> Path:
    run_dir = tmp_path_factory.mktemp("eval_independent") / "run"
    proc = run_train(run_dir, *TRAIN, cache_dir=data_cache)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run_dir


def evaluate(run_dir: Path, out: Path, data_cache: Path, *layout: str, nproc: int = 1) -> dict:
    """tools.evaluate's --output record (with lm-eval's samples), as a user runs it."""
    launcher = ([sys.executable] if nproc == 1 else
                [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc-per-node={nproc}"])
    proc = subprocess.run([*launcher, "-m", "tools.evaluate", str(run_dir), "--tasks", TASK,
                           "--limit", str(LIMIT), "--output", str(out), "--log-samples",
                           *layout], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "NVFP4_CACHE": str(data_cache)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())


def choice_logliks(samples: list[dict]) -> dict[int, list[float]]:
    """doc id -> each choice's log-likelihood (lm-eval's (loglik, is_greedy) per choice)."""
    return {s["doc_id"]: [float(ll) for ll, _greedy in s["filtered_resps"]] for s in samples}


@pytest.fixture(scope="module")
def tp1(run, data_cache, tmp_path_factory) -> dict:
    return evaluate(run, tmp_path_factory.mktemp("tp1") / "results.json", data_cache)


def assert_same_scores(ours: dict, theirs_samples: list[dict], theirs_acc: float, tol: float):
    """Per choice within `tol`; the same answer wherever the reference's best choice leads the
    next by more than 2 x tol (a closer call may flip within the tolerance), and so the
    accuracy within the share of such close calls."""
    mine = choice_logliks(ours["samples"][TASK])
    theirs = choice_logliks(theirs_samples)
    assert mine.keys() == theirs.keys() and len(mine) == LIMIT
    worst = max(abs(a - b) for d in theirs for a, b in zip(mine[d], theirs[d]))
    assert worst <= tol, worst
    close = 0
    for d, ref in theirs.items():
        ranked = sorted(ref, reverse=True)
        if ranked[0] - ranked[1] <= 2 * tol:
            close += 1
            continue
        assert mine[d].index(max(mine[d])) == ref.index(ranked[0]), (d, mine[d], ref)
    acc = ours["metrics"][f"eval/{TASK}/acc"]
    assert abs(acc - theirs_acc) <= close / LIMIT, (acc, theirs_acc, close)


def test_evaluate_matches_lm_evals_hflm_on_the_hf_export(run, tp1, tmp_path):
    pytest.importorskip("transformers", reason="the Hugging Face extra: pip install -e '.[hf]'")
    pytest.importorskip("accelerate", reason="lm-eval's HFLM imports accelerate")
    from lm_eval.models.huggingface import HFLM

    from tools import hf_export
    from training.downstream import evaluate as lm_eval_evaluate
    from training.downstream import flat_metrics, prepare_tasks

    export = tmp_path / "hf"
    assert hf_export.main([str(run), "--output", str(export)]) == 0
    # lm-eval's own model class on the exported directory, offline (prepare_tasks sets the
    # Hugging Face libraries offline). No BOS: the project's requests carry none either.
    hflm = HFLM(pretrained=str(export), dtype="float32", device="cpu", batch_size=8,
                add_bos_token=False)
    results = lm_eval_evaluate(hflm, [TASK], prepare_tasks([TASK]), limit=LIMIT,
                               log_samples=True)
    theirs_acc = flat_metrics(results)[f"eval/{TASK}/acc"]
    assert_same_scores(tp1, results["samples"][TASK], theirs_acc, LOGLIK_TOL)


def test_tp2_and_pp2_give_the_tp1_scores(run, tp1, data_cache, tmp_path):
    tp2 = evaluate(run, tmp_path / "tp2.json", data_cache, "--tensor", "2", nproc=2)
    assert_same_scores(tp2, tp1["samples"][TASK], tp1["metrics"][f"eval/{TASK}/acc"], LOGLIK_TOL)
    # The demo's 9 layers in stages of 5 and 4 (parallel.first_stage_layers's rule).
    pp2 = evaluate(run, tmp_path / "pp2.json", data_cache, "--pipeline", "2",
                   "--first-stage-layers", "5", nproc=2)
    assert_same_scores(pp2, tp1["samples"][TASK], tp1["metrics"][f"eval/{TASK}/acc"], PP_TOL)
    assert pp2["metrics"] == pytest.approx(tp1["metrics"], abs=PP_TOL)


# demo_moe at the test size: 8 routed experts of 64, top-2, a shared expert of 64, sigmoid
# scores with the expert bias (which 2 steps move off zero). Weights drawn at std 0.05, not
# 0.02: at 0.02 the experts' outputs are so small that sending every token to other experts
# moved no log-likelihood by more than 5e-3 nats, under the tolerance, so a routing bug would
# pass unseen; at 0.05 it moves them by 0.095.
MOE_TRAIN = [*TRAIN, "model=demo_moe", "model.moe.ffn_hidden_size=64",
             "model.moe.shared_expert_ffn_hidden_size=64", "model.init_method_std=0.05"]
# |project - HFLM| per request for that MoE run: the BF16 rounding of the activations as for the
# dense run, larger with the larger weights, and the routers' near-ties it can flip: measured
# 1.3e-2 nats (torch 2.13 CPU, FP32 GEMMs). Tolerance 3x that, under the 0.095 a rerouting moves.
MOE_LOGLIK_TOL = 4e-2


def _worst(ours: dict, theirs_samples: list[dict]) -> float:
    mine, theirs = choice_logliks(ours["samples"][TASK]), choice_logliks(theirs_samples)
    return max(abs(a - b) for d in theirs for a, b in zip(mine[d], theirs[d]))


def test_an_moe_runs_scores_match_lm_evals_hflm_on_its_hf_export_and_at_tp2(tmp_path,
                                                                             data_cache):
    """Downstream evaluation of a hybrid MoE: tools.evaluate on the run against lm-eval's HFLM
    on its export to transformers' NemotronH with `moe` layers (the routers score in FP32 on both
    sides, from the project's BF16 activations and HFLM's FP32 ones). The same export with every
    layer's expert bias pushed to experts 0 and 1 scores beyond the tolerance: the comparison
    sees routing. TP=2 without sequence parallelism, where the experts are split over the
    tensor-parallel ranks and the all-to-all dispatcher spans them, gives TP=1's scores within
    the dense TP tolerance (the same BF16 roundings of partial sums)."""
    pytest.importorskip("transformers", reason="the Hugging Face extra: pip install -e '.[hf]'")
    pytest.importorskip("accelerate", reason="lm-eval's HFLM imports accelerate")
    from lm_eval.models.huggingface import HFLM
    from safetensors.torch import load_file, save_file

    from tools import hf_export
    from training.downstream import evaluate as lm_eval_evaluate
    from training.downstream import flat_metrics, prepare_tasks

    def hflm_scores(export: Path) -> dict:
        hflm = HFLM(pretrained=str(export), dtype="float32", device="cpu", batch_size=8,
                    add_bos_token=False)
        return lm_eval_evaluate(hflm, [TASK], prepare_tasks([TASK]), limit=LIMIT,
                                log_samples=True)

    run_dir = tmp_path / "run"
    proc = run_train(run_dir, *MOE_TRAIN, cache_dir=data_cache)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ours = evaluate(run_dir, tmp_path / "moe.json", data_cache)
    export = tmp_path / "hf"
    assert hf_export.main([str(run_dir), "--output", str(export)]) == 0
    assert '"n_routed_experts": 8' in (export / "config.json").read_text()
    results = hflm_scores(export)
    assert_same_scores(ours, results["samples"][TASK], flat_metrics(results)[f"eval/{TASK}/acc"],
                       MOE_LOGLIK_TOL)

    skewed = tmp_path / "hf-skewed"
    shutil.copytree(export, skewed)
    for path in skewed.glob("*.safetensors"):
        tensors = load_file(path)
        for name in [n for n in tensors if n.endswith("mixer.gate.e_score_correction_bias")]:
            tensors[name] = torch.tensor([10.0, 10.0] + [0.0] * 6)
        save_file(tensors, path, metadata={"format": "pt"})
    assert _worst(ours, hflm_scores(skewed)["samples"][TASK]) > MOE_LOGLIK_TOL

    tp2 = evaluate(run_dir, tmp_path / "moe-tp2.json", data_cache, "--tensor", "2", nproc=2)
    assert_same_scores(tp2, ours["samples"][TASK], ours["metrics"][f"eval/{TASK}/acc"],
                       LOGLIK_TOL)

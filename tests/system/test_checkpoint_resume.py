"""Resuming from real checkpoints, as a user (or a Slurm requeue) would:

- train.py: no code runs from a checkpoint, no run is silently thrown away, no resume ends in a
  traceback (the in-process checks: tests/training/test_checkpoint_safety.py);
- a checkpoint written on one layer-spec family resumes on the other
  (tests/training/test_checkpoint_layouts.py);
- over two gloo processes, each rank hashes the files it wrote and verifies them at resume
  (who hashes what: tests/training/test_checkpoint_hashing.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import re
import shutil
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import RunsCode, flip_byte, free_port, snapshot
from train_helpers import FAST, REPO, RESUMABLE, rewound_copy, run_train, step_losses
from training.metrics import read_metrics

from training import checkpoint as ckpt
from training.checkpoint import MANIFEST, verify_checkpoint


# -- train.py on a real checkpoint ------------------------------------------------------------


def _rehash(checkpoint: Path, name: str) -> None:
    """Update the manifest as an attacker who can write the run directory would."""
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    data = (checkpoint / name).read_bytes()
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))


ARGS = [*FAST, "precision=bf16", "trainer.save_every=1", "trainer.eval_every=100",
        "trainer.keep_last=10"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_cache) -> Path:
    """A run directory with checkpoints at steps 1 and 2."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    proc = run_train(run_dir, *ARGS, "trainer.max_steps=2", cache_dir=data_cache)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run_dir


def _copy(trained: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    return run_dir


def test_resume_refuses_a_crafted_metadata_and_runs_nothing(trained, tmp_path, data_cache):
    run_dir = _copy(trained, tmp_path)
    marker = tmp_path / "pwned"
    newest = run_dir / "checkpoints" / "step_0000002"
    (newest / "dist" / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    _rehash(newest, "dist/.metadata")
    before = snapshot(run_dir / "checkpoints")
    proc = run_train(run_dir, *ARGS, "trainer.max_steps=3", cache_dir=data_cache)
    log = proc.stdout + proc.stderr
    assert not marker.exists(), log
    assert proc.returncode == 6, log
    assert f"refusing {newest / 'dist' / '.metadata'}" in log and "Traceback" not in log
    assert snapshot(run_dir / "checkpoints") == before


def test_every_checkpoint_corrupt_stops_with_exit_6_until_restart_is_chosen(
        trained, tmp_path, data_cache):
    run_dir = _copy(trained, tmp_path)
    for checkpoint in (run_dir / "checkpoints").glob("step_*"):
        shard = checkpoint / "dist" / "__0_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    checkpoints = snapshot(run_dir / "checkpoints")
    metrics = (run_dir / "metrics.jsonl").read_text()
    proc = run_train(run_dir, *ARGS, "trainer.max_steps=3", cache_dir=data_cache)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 6, log
    assert "none is usable" in log and "run.resume=restart" in log and "Traceback" not in log
    assert snapshot(run_dir / "checkpoints") == checkpoints  # nothing deleted or replaced
    assert (run_dir / "metrics.jsonl").read_text() == metrics  # no second step 1

    proc = run_train(run_dir, *ARGS, "trainer.max_steps=1", "run.resume=restart",
                     cache_dir=data_cache)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    abandoned = list((run_dir / "checkpoints").glob("abandoned-*"))
    assert len(abandoned) == 1 and snapshot(abandoned[0]) == checkpoints
    assert (run_dir / "checkpoints" / "step_0000001" / MANIFEST).exists()
    events = [m for m in read_metrics(run_dir) if m.get("event") == "restart"]
    assert len(events) == 1


def test_resume_with_another_model_shape_is_one_line_and_exit_2(trained, tmp_path, data_cache):
    run_dir = _copy(trained, tmp_path)
    proc = run_train(run_dir, *ARGS, "trainer.max_steps=3", "model.hidden_size=128",
                     cache_dir=data_cache)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 2, log
    assert "does not fit this model" in log and "Traceback" not in log
    line = next(line for line in log.splitlines() if "does not fit this model" in line)
    assert "shape mismatch" in line and len(line) < 600


def test_consecutive_skips_stop_the_run_and_keep_the_last_clean_checkpoint(tmp_path, data_cache):
    run_dir = tmp_path / "run"
    # An absurd learning rate without clipping: step 1 updates, every later loss is not finite.
    proc = run_train(run_dir, *ARGS, "trainer.max_steps=8", "trainer.keep_last=1",
                     "trainer.lr=1e12", "trainer.grad_clip=0", "trainer.warmup_steps=0",
                     "trainer.on_nan=skip", "trainer.max_consecutive_skips=3",
                     cache_dir=data_cache)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 4, log
    assert "3 steps in a row (trainer.max_consecutive_skips=3)" in log
    metrics = [m for m in read_metrics(run_dir) if "loss" in m]
    assert [m["step"] for m in metrics] == [1, 2, 3] and metrics[-1]["skipped_steps"] == 2
    kept = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    # keep_last=1 keeps step 3 (written after skipped steps) and the last clean one, step 1
    assert kept == ["step_0000001", "step_0000003"], kept
    manifest = json.loads((run_dir / "checkpoints" / "step_0000001" / MANIFEST).read_text())
    assert manifest["skipped_since_previous"] == 0


# -- across the layer-spec families -----------------------------------------------------------


# A demo run "on the TE spec" as far as a CPU allows: train.py with its checkpoints written as
# the TE spec names them (the wrapper below), then plain train.py (the portable spec) resumes.
SAVE_AS_TE = """
import runpy, sys
sys.path.insert(0, {repo!r})
import training.checkpoint as ckpt

real_state, real_save = ckpt._sharded_state, ckpt.save_checkpoint
ckpt._sharded_state = lambda *a: ckpt._in_spec(real_state(*a), "te")
ckpt.save_checkpoint = lambda *a, **kw: real_save(*a, **{{**kw, "spec": "te"}})
sys.argv = [{train!r}, *sys.argv[1:]]
runpy.run_path({train!r}, run_name="__main__")
"""


def test_a_demo_run_saved_by_the_te_spec_resumes_on_the_portable_spec(tmp_path, data_cache,
                                                                      shared_runs):
    whole, _ = shared_runs.get(*RESUMABLE)
    expected = step_losses(whole)

    script = tmp_path / "save_as_te.py"
    script.write_text(textwrap.dedent(SAVE_AS_TE.format(repo=str(REPO),
                                                         train=str(REPO / "train.py"))))
    te = tmp_path / "te-run"
    proc = run_train(te, *RESUMABLE, cache_dir=data_cache, script=script)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    crossed = tmp_path / "crossed"
    rewound_copy(te, crossed, 2)
    manifest = json.loads((crossed / "checkpoints" / "step_0000002" / ckpt.MANIFEST).read_text())
    assert manifest["spec"] == "te"
    proc = run_train(crossed, *RESUMABLE, cache_dir=data_cache)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert re.search(r"step_0000002: optimizer state in the fully_reshardable layout.*keys of the "
                     r"te spec translated to the portable spec's", log), log[-3000:]
    got = step_losses(crossed)
    assert [got[s] for s in (3, 4)] == [expected[s] for s in (3, 4)]  # bit for bit


# -- two gloo processes -------------------------------------------------------------------------


def _worker(rank: int, world: int, port: int, root: str, out: str, phase: str) -> None:
    """One rank: save step_2 and step_4 ("save"), step_4 again ("resave"), or pick the
    checkpoint to resume ("resume");
    write which files this rank hashed (and, on rank 0, the warnings) to out/<phase>_rank<r>.json."""
    from training import checkpoint as ckpt
    from training.distributed import init_distributed, shutdown

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    hashed: list[str] = []
    real = ckpt._sha256

    def spy(path: Path) -> str:
        hashed.append(str(path))
        return real(path)

    ckpt._sha256 = spy
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("nvfp4_pretrain").addHandler(handler)
    ctx = init_distributed(1, 1, "gloo")
    result: dict = {}
    try:
        if phase in ("save", "resave"):
            from model.build import build_model
            from model.config import ModelConfig
            from nvfp4_recipe.policy import PrecisionConfig
            from training import ddp_optimizer as mp
            from training.config import TrainerConfig

            torch.manual_seed(0)
            core = build_model(ModelConfig(vocab_size=256, hidden_size=64, ffn_hidden_size=128),
                               PrecisionConfig(name="bf16", format="bf16"), vocab_size=256,
                               backend="emulated", params_dtype=mp.PARAMS_DTYPE).module
            _, optimizer = mp.build_data_parallel_model(core, TrainerConfig(), ctx)
            for step in (2, 4) if phase == "save" else (4,):
                ckpt.save_checkpoint(Path(root), step, ctx, model=core, optimizer=optimizer,
                                     optimizer_format=mp.optimizer_checkpoint_format(ctx.device,
                                                                                     False),
                                     trainer_state={"step": step}, keep_last=0)
        else:
            try:
                result["found"] = ckpt.find_resume_checkpoint(Path(root), ctx).name
            except ckpt.NoUsableCheckpoint as exc:
                result["error"] = str(exc)
    finally:
        shutdown()
    Path(out, f"{phase}_rank{rank}.json").write_text(json.dumps(
        {"hashed": hashed, "warnings": warnings, **result}))


def _inside(path: str, directory_prefix: str):
    """`path` relative to its ancestor whose name starts with `directory_prefix` (None: none)."""
    parts = Path(path).parts
    top = next((i for i, part in enumerate(parts) if part.startswith(directory_prefix)), None)
    return None if top is None else str(Path(*parts[top + 1:]))


def _run(phase: str, root: Path, out: Path) -> list[dict]:
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(2, free_port(), str(root), str(out), phase), nprocs=2, join=True)
    return [json.loads((out / f"{phase}_rank{r}.json").read_text()) for r in (0, 1)]


def test_two_ranks_hash_their_own_files_and_resume_catches_a_flipped_byte_in_rank_1s(tmp_path):
    root, out = tmp_path / "checkpoints", tmp_path / "out"
    out.mkdir()
    saved = _run("save", root, out)
    newest = root / "step_0000004"
    files = json.loads((newest / MANIFEST).read_text())["files"]
    by_rank = {r: {n for n, m in files.items() if m["rank"] == r} for r in (0, 1)}
    # rank 1 wrote (and hashed) its own shard and RNG; rank 0 its shard and the shared files
    assert "rng_rank1.pt" in by_rank[1] and any(n.startswith("dist/__1_") for n in by_rank[1])
    assert {"trainer.pt", "rng_rank0.pt", "dist/.metadata"} <= by_rank[0]
    assert by_rank[0] | by_rank[1] == set(files) and not by_rank[0] & by_rank[1]
    for r in (0, 1):  # each rank hashed exactly the files the manifest gives it, no others
        mine = {_inside(p, ".tmp-step_0000004") for p in saved[r]["hashed"]} - {None}
        assert mine == by_rank[r], (r, mine, by_rank[r])
    assert verify_checkpoint(newest) is None

    shard = sorted(n for n in by_rank[1] if n.endswith(".distcp"))[0]
    flip_byte(newest / shard)
    resumed = _run("resume", root, out)
    assert resumed[0]["found"] == resumed[1]["found"] == "step_0000002"  # the older one
    warning = next(w for w in resumed[0]["warnings"] if "step_0000004" in w)
    assert f"{shard} does not match its checksum (found by rank 1)" in warning, warning
    # rank 0 never read rank 1's file: the check ran where the file was written
    assert not any(p.endswith(shard) for p in resumed[0]["hashed"])
    assert any(p.endswith(shard) for p in resumed[1]["hashed"])

    # saving step 4 again: the corrupt one is checked the same way and moved aside for what it is
    resaved = _run("resave", root, out)
    moved = next(w for w in resaved[0]["warnings"] if w.startswith("moved step_0000004"))
    assert f"unusable ({shard} does not match its checksum, found by rank 1)" in moved, moved
    assert not any(p.endswith(shard) and "abandoned" not in p and ".tmp" not in p
                   for p in resaved[0]["hashed"])
    (aside,) = root.glob("abandoned-*")
    assert (aside / "step_0000004" / shard).exists() and verify_checkpoint(newest) is None

"""Compose the config as train.py does; run train.py in a subprocess (as a user would) and read what
it wrote."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from training.grad_health import layer_name
from training.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
# The launchers that start train.py on a cluster: torchrun on one node, and the Slurm batch job.
TORCHRUN_SH = REPO / "launch" / "torchrun.sh"
SLURM_SBATCH = REPO / "launch" / "slurm.sbatch"

# The demo at test size (seconds per step on 2 cores: recipes/trainer/fast.yaml), without W&B.
FAST = ["trainer=fast", "logger=disabled"]
# Four demo steps with checkpoints at steps 2 and 4: the run most resume and layout tests continue
# (from shared_runs, so that each layout trains it once per session).
RESUMABLE = [*FAST, "trainer.max_steps=4", "trainer.save_every=2", "trainer.eval_every=100"]
# Six demo steps with a checkpoint every 2: the runs the fault and run-directory tests stop,
# kill and resume.
SIX_STEPS = [*FAST, "trainer.max_steps=6", "trainer.save_every=2", "trainer.eval_every=100"]
# The demo pattern (9 layers) over two pipeline stages, 5 + 4.
TWO_STAGES = ["parallel.pipeline=2", "parallel.first_stage_layers=5"]

# The demo pattern's layers (M-M*-M-M-) and the per-group gradient-health keys a step of it logs.
KINDS = ["mamba", "mlp", "mamba", "attention", "mlp", "mamba", "mlp", "mamba", "mlp"]
GROUPS = ["embedding", *(layer_name(i, KINDS) for i in range(9)), "final_norm", "output_layer"]
HEALTH_KEYS = {f"grad/{g}/{s}" for g in GROUPS for s in ("norm", "nonfinite_frac")}


def compose_train(*overrides: str):
    """The TrainConfig train.py would run with these overrides."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from training.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(RECIPES), version_base="1.3"):
        return OmegaConf.to_object(compose(config_name="train", overrides=list(overrides)))


def run_train(run_dir: Path, *overrides: str, nproc: int = 1, cache_dir: Path | None = None,
              timeout: int = 600, env: dict | None = None,
              script: Path | None = None) -> subprocess.CompletedProcess:
    """train.py (or `script`, a test wrapper around it) with these overrides."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if cache_dir is not None:
        full_env["NVFP4_CACHE"] = str(cache_dir)
    args = [f"run.dir={run_dir}", *overrides]
    if nproc == 1:
        cmd = [sys.executable, str(script or REPO / "train.py"), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "--local-ranks-filter=0", str(script or REPO / "train.py"), *args]
    return subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def train_in_process(run_dir: Path, cache_dir: Path, *overrides: str) -> list:
    """The StepResults of trainer.max_steps steps of a one-process Trainer (gloo) built as
    train.py builds it, in this process: the CLI's steps without an interpreter start, for tests
    that compare settings. Nothing is saved or evaluated; the process group is torn down after."""
    from training.distributed import init_distributed, shutdown
    from training.run_dir import release_run_dir
    from training.trainer import Trainer, prepare_run_dir

    cfg = compose_train(*overrides, f"run.dir={run_dir}", f"data.cache_dir={cache_dir}/data")
    ctx = init_distributed(1, 1, "gloo")
    try:
        prepare_run_dir(cfg, ctx)
        trainer = Trainer(cfg, ctx)
        steps = []
        for _ in range(cfg.trainer.max_steps):
            steps.append(trainer.train_step(trainer.data.train.next_global_batch()))
            trainer.step += 1
        return steps
    finally:
        release_run_dir(run_dir)
        shutdown()


class SharedRuns:
    """train.py runs several tests read: each distinct (overrides, nproc) trains once per session
    (the `shared_runs` fixture). A test reads a shared run's metrics, log and checkpoints, and
    copies it (rewound_copy) to continue it; `get` fails the test that finds a run changed since
    it was made, so a test that wrote into one cannot pass silently."""

    def __init__(self, root: Path, cache_dir: Path):
        self.root, self.cache_dir = root, cache_dir
        self._runs: dict[tuple, tuple[Path, str, dict]] = {}

    def get(self, *overrides: str, nproc: int = 1) -> tuple[Path, str]:
        """(run dir, stdout + stderr) of train.py with these overrides on `nproc` processes."""
        key = (overrides, nproc)
        if key not in self._runs:
            run_dir = self.root / f"run{len(self._runs)}"
            proc = run_train(run_dir, *overrides, nproc=nproc, cache_dir=self.cache_dir)
            log = proc.stdout + proc.stderr
            assert proc.returncode == 0, f"shared run {key} failed:\n{log[-3000:]}"
            self._runs[key] = (run_dir, log, _fingerprint(run_dir))
        run_dir, log, made = self._runs[key]
        assert _fingerprint(run_dir) == made, f"a test changed the shared run {key}: copy it first"
        return run_dir, log


def _fingerprint(run_dir: Path) -> dict:
    return {str(p.relative_to(run_dir)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


def patched_train_script(path: Path, patch: str) -> Path:
    """A wrapper script for run_train(script=...): `patch` (Python source: a fault or a stated
    machine, applied to the project's modules) runs first, then train.py with the given arguments."""
    path.write_text(f"import runpy, sys\nsys.path.insert(0, {str(REPO)!r})\n{patch}\n"
                    f"sys.argv = [{str(REPO / 'train.py')!r}, *sys.argv[1:]]\n"
                    f"runpy.run_path(sys.argv[0], run_name='__main__')\n")
    return path


def step_losses(run_dir: Path) -> dict[int, float]:
    """step -> loss of the last record for that step (a resumed run re-logs its steps)."""
    return {m["step"]: m["loss"] for m in read_metrics(run_dir) if "loss" in m}


def rewound_copy(src: Path, dst: Path, step: int) -> Path:
    """A copy of the run at `src` as if it had stopped after `step`: the checkpoints after it and
    the metrics records after it dropped, so train.py resumes from step_<step> into `dst`."""
    from training.checkpoint import named_step, step_dir_name, step_dirs

    shutil.copytree(src, dst)
    later = [d for d in step_dirs(dst / "checkpoints") if (named_step(d) or 0) > step]
    assert (dst / "checkpoints" / step_dir_name(step)).is_dir() and later, (src, step)
    for checkpoint in later:
        shutil.rmtree(checkpoint)
    kept = [json.dumps(r) for r in read_metrics(dst) if r["step"] <= step]
    (dst / "metrics.jsonl").write_text("\n".join(kept) + "\n")
    return dst


def popen_train(run_dir: Path, cache_dir: Path, *overrides: str,
                env: dict | None = None) -> subprocess.Popen:
    """train.py in the background, in its own session (so a test can signal or kill the group)."""
    full_env = {**os.environ, "NVFP4_CACHE": str(cache_dir), "PYTHONUNBUFFERED": "1",
                **(env or {})}
    return subprocess.Popen([sys.executable, str(REPO / "train.py"), f"run.dir={run_dir}",
                             *overrides], cwd=REPO, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 300):
    """Until metrics.jsonl records `step` (the process must still be running)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (Path(run_dir) / "metrics.jsonl").exists():
            done = [m["step"] for m in read_metrics(run_dir) if "loss" in m]
            if done and done[-1] >= step:
                return
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.05)
    raise TimeoutError(f"step {step} not reached")

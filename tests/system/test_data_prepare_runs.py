"""data.prepare and its shards, from processes of their own: a run killed mid-way and rerun leaves
no temporaries; a second run on the same prefix is refused while the first writes; the Slurm
array of launch/prepare.sbatch (on the local Slurm of .ci/slurm-up.sh; skips without one) gives
the one-process tokens and redoes a killed task alone; and train.py on a schedule that globs the
shards trains and resumes bit for bit (in one process: tests/data/test_data_prepare.py,
test_data_prepare_safety.py, test_data_prepare_slurm.py, test_data_shards.py)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from data.indexed import open_indexed
from data.prepare import cli
from errors import ExitCode
from tests.prepare_helpers import (OTHER, SBATCH, TEXTS, args, decoded, hook_first_batch, jsonl,
                                   make_shards, no_temporaries, one_error_line, write_jsonl)

REPO = Path(__file__).resolve().parents[2]


def test_sigkill_mid_way_then_a_rerun_leaves_no_temporaries(tmp_path, tiny_tokenizer):
    import signal
    import subprocess
    import sys
    import time

    texts = [f"document {i}: " + "lorem ipsum dolor sit amet " * (i % 40 + 1) for i in range(60000)]
    write_jsonl(tmp_path / "in.jsonl", texts)
    out = tmp_path / "ds"
    args = [str(tmp_path / "in.jsonl"), "--tokenizer", tiny_tokenizer, "--output", str(out),
            "--no-progress", "--batch-bytes", "20000"]
    proc = subprocess.Popen([sys.executable, "-m", "data.prepare", *args],
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    deadline = time.time() + 120
    while not [p for p in os.listdir(tmp_path) if ".tmp-" in p]:
        assert proc.poll() is None and time.time() < deadline, "no temporary appeared"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not no_temporaries(tmp_path) and not IndexedDataset.exists(str(out))  # what the kill left
    assert cli.main(args) == 0
    assert no_temporaries(tmp_path) and IndexedDataset.exists(str(out))


def test_a_second_prepare_on_the_same_prefix_is_refused_while_the_first_runs(
        tmp_path, tiny_tokenizer, monkeypatch, capsys):
    """The later run starts while the earlier tokenizes: refused at once naming the first (it
    would otherwise replace the earlier's dataset, or be replaced by it); once the first has
    finished, the output exists and the later run is refused as before."""
    out = tmp_path / "o" / "web"
    mine, theirs = jsonl(tmp_path / "a.jsonl", TEXTS), jsonl(tmp_path / "b.jsonl", OTHER)

    def second():
        return subprocess.run([sys.executable, "-m", "data.prepare",
                               *args([theirs], tiny_tokenizer, out)],
                              cwd=REPO, capture_output=True, text=True, timeout=300)

    seen = hook_first_batch(monkeypatch, second)
    assert cli.main(args([mine], tiny_tokenizer, out, "--batch-bytes", "200")) == 0
    proc = seen[0]
    assert proc.returncode == ExitCode.IN_USE, proc.stdout + proc.stderr
    line = one_error_line(proc.stderr)
    assert f"{out}: another data.prepare is writing it" in line and f"pid {os.getpid()}" in line
    assert decoded(out, tiny_tokenizer) == TEXTS
    assert sorted(p.name for p in out.parent.iterdir()) == ["web.bin", "web.idx", "web.json"]

    capsys.readouterr()
    assert cli.main(args([theirs], tiny_tokenizer, out)) == 2  # after: "output exists"
    assert "refusing to overwrite" in one_error_line(capsys.readouterr().err)
    assert decoded(out, tiny_tokenizer) == TEXTS


WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
         "sigma tau upsilon phi chi psi omega").split()


def _corpus(d: Path) -> None:
    """~6 MB of JSONL in four files of unequal size, a few malformed lines among them."""
    rng = random.Random(0)
    d.mkdir()
    for k, n in enumerate((4000, 9000, 1500, 5500)):
        with open(d / f"part{k}.jsonl", "w") as f:
            for i in range(n):
                f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 90)))}) + "\n")
                if i % 1000 == 17:
                    f.write("{broken\n")


def _submit(tmp_path: Path, out: Path, corpus: Path, tok: str, *sbatch_args: str) -> str:
    # --oversubscribe lifts the script's --exclusive so that the three tasks share the CI node;
    # WORKERS=1 keeps them to one tokenizer process each on its two cores.
    cmd = ["sbatch", "--parsable", "--array=0-2", "--oversubscribe", "--time=10",
           f"--output={tmp_path}/slurm-%A_%a.out", *sbatch_args, str(SBATCH), str(corpus),
           "--tokenizer", tok, "--output", str(out), "--batch-bytes", "16384"]
    env = {**os.environ, "WORKERS": "1", "PYTHON": sys.executable, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=True)
    return proc.stdout.strip().split(";")[0]


def _wait_gone(job: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip():
            return
        time.sleep(0.5)
    subprocess.run(["scancel", job])
    pytest.fail(f"array job {job} still queued after {timeout} s")


def _tokens(prefixes) -> list:
    out = []
    for p in prefixes:
        ds = open_indexed(str(p))
        out += [np.array(ds[i]) for i in range(len(ds))]
    return out


@pytest.mark.slurm
def test_array_shards_equal_one_process_and_a_killed_task_is_redone_alone(slurm, tmp_path, tiny_tokenizer, capsys):
    corpus, out = tmp_path / "corpus", tmp_path / "data" / "web"
    _corpus(corpus)
    shards = [Path(f"{out}_shard{i}") for i in range(3)]
    job = _submit(tmp_path, out, corpus, tiny_tokenizer)
    try:
        # kill task 1 once it is writing (its temporaries exist), as a node loss or scancel would
        deadline = time.monotonic() + 240
        while not (temporaries := list(out.parent.glob("web_shard1.tmp-*"))):
            assert time.monotonic() < deadline, "task 1 never started writing"
            assert not shards[1].with_suffix(".idx").exists(), "task 1 finished before it could be killed"
            time.sleep(0.02)
        # A shard takes ~2 s on an idle machine, less than scancel may take to deliver its
        # signal: freeze the writer first (its pid is in its temporaries' names, data/indexed.py
        # writer_tag; the local Slurm runs on this host). scancel sends SIGCONT with its SIGTERM.
        writer = int(temporaries[0].name.split(".tmp-", 1)[1].split("@", 1)[0])
        os.kill(writer, signal.SIGSTOP)
        assert not shards[1].with_suffix(".idx").exists(), "task 1 finished before it could be killed"
        subprocess.run(["scancel", f"{job}_1"], check=True)
        _wait_gone(job, 240)
    finally:
        subprocess.run(["scancel", job])
    log = lambda i: (tmp_path / f"slurm-{job}_{i}.out").read_text()  # noqa: E731
    assert not shards[1].with_suffix(".idx").exists(), log(1)
    for i in (0, 2):
        assert shards[i].with_suffix(".idx").exists(), log(i)
    capsys.readouterr()
    assert cli.main(["--check", str(out)]) == 3
    assert f"error: {shards[1]}: " in capsys.readouterr().err
    kept = {i: os.stat(f"{shards[i]}.bin") for i in (0, 2)}

    # re-submit the same array: tasks 0 and 2 find their shard complete, task 1 rebuilds its own
    again = _submit(tmp_path, out, corpus, tiny_tokenizer)
    _wait_gone(again, 300)
    relog = lambda i: (tmp_path / f"slurm-{again}_{i}.out").read_text()  # noqa: E731
    for i in (0, 2):
        assert f"shard {i}/3 is complete" in relog(i) and "skipped" in relog(i), relog(i)
        now = os.stat(f"{shards[i]}.bin")
        assert (now.st_ino, now.st_mtime_ns) == (kept[i].st_ino, kept[i].st_mtime_ns)
    assert "data.prepare -> " in relog(1), relog(1)
    assert not list(out.parent.glob("*.tmp-*"))
    assert cli.main(["--check", str(out)]) == 0
    check = capsys.readouterr().out

    # the shards, in order, are exactly what one process makes of the same inputs
    single = tmp_path / "single" / "web"
    assert cli.main([str(corpus), "--tokenizer", tiny_tokenizer, "--output", str(single), "--no-progress"]) == 0
    whole, parts = _tokens([single]), _tokens(shards)
    assert len(whole) == len(parts) and all(np.array_equal(a, b) for a, b in zip(whole, parts))
    total = json.loads(Path(f"{single}.json").read_text())["tokens"]
    assert f"{total:,}" in check
    assert all(json.loads(Path(f"{s}.json").read_text())["documents"] > 0 for s in shards)


def test_training_on_globbed_shards_trains_and_resumes_bit_for_bit(tmp_path, tiny_tokenizer, data_cache):
    """train.py with a schedule whose categories glob data.prepare shards: it trains, and a run
    resumed from its step-3 checkpoint reproduces the uninterrupted losses."""
    from train_helpers import FAST, rewound_copy, run_train, step_losses
    from training.metrics import read_metrics

    make_shards(tmp_path / "d", tiny_tokenizer, 3, name="web", sizes=(800, 800, 300))
    make_shards(tmp_path / "d", tiny_tokenizer, 2, name="code", sizes=(500, 100, 100), seed=7)
    make_shards(tmp_path / "d", tiny_tokenizer, 2, name="val", sizes=(200, 50, 50), seed=9)
    recipes = tmp_path / "recipes" / "data"
    recipes.mkdir(parents=True)
    (recipes / "globbed.yaml").write_text(f"""
name: globbed
tokenizer: {tiny_tokenizer}
categories:
  web: {{prefixes: ["{tmp_path}/d/web_shard*"]}}
  code: {{prefixes: ["{tmp_path}/d/code_shard*"]}}
validation:
  web: ["{tmp_path}/d/val_shard*"]
phases:
  - {{name: a, end_fraction: 0.5, weights: {{web: 0.7, code: 0.3}}}}
  - {{name: b, end_fraction: 1.0, weights: {{web: 0.3, code: 0.7}}}}
""")
    args = [*FAST, f"hydra.searchpath=[file://{tmp_path / 'recipes'}]", "data=globbed",
            "trainer.max_steps=6", "trainer.save_every=3", "trainer.eval_every=3"]
    straight = tmp_path / "straight"
    proc = run_train(straight, *args, cache_dir=data_cache)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    expected = step_losses(straight)
    assert sorted(expected) == [1, 2, 3, 4, 5, 6] and expected[6] < expected[1]
    records = read_metrics(straight)
    last = [r for r in records if "loss" in r][-1]
    assert last["data/tokens/web"] > 0 and last["data/tokens/code"] > 0 and "val_loss" in last

    resumed = rewound_copy(straight, tmp_path / "resumed", 3)
    proc = run_train(resumed, *args, cache_dir=data_cache)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resumed from" in proc.stdout and "step_0000003" in proc.stdout
    assert step_losses(resumed) == expected
    assert not any(IndexedDataset.exists(str(p)[:-4]) for p in (tmp_path / "d").glob("*.tmp-*"))

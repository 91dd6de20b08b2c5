"""launch/prepare.sbatch on the local Slurm of .ci/slurm-up.sh: a 3-task array tokenizes a few MB
of JSONL into shards whose tokens, in order, are a single-process run's; a task killed mid-way
leaves no shard, `--check` names it, and re-submitting the array rebuilds only that shard.

Skips itself unless `sinfo`/`sbatch` are installed, SLURM_CONF is set and the node answers.
"""

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

from data.indexed import open_indexed
from data.prepare import cli

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "launch" / "prepare.sbatch"
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
         "sigma tau upsilon phi chi psi omega").split()


def test_prepare_sbatch_parses():
    assert os.access(SBATCH, os.X_OK), f"{SBATCH} is not executable"
    proc = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


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


@pytest.mark.slow
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

"""What the data.prepare tests of both tiers share: small corpora, JSONL inputs, the command's
arguments, its dataset decoded back to text, its one error line, a hook into its first batch,
whether a directory holds a writer's temporaries, and shards prepared with `--shard I/N`."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from data.indexed import open_indexed
from data.prepare import cli, tokenizing

# launch/prepare.sbatch: the Slurm array that runs the shards.
SBATCH = Path(__file__).resolve().parents[1] / "launch" / "prepare.sbatch"
TEXTS = [f"document {i}: " + "alpha beta gamma " * (i % 7 + 1) for i in range(40)]
OTHER = [f"another corpus {i}: delta epsilon" for i in range(25)]
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def jsonl(path: Path, texts) -> Path:
    """Each text as a JSON line {"text": ...}; returns `path`."""
    path.write_bytes(b"".join(json.dumps({"text": t}).encode() + b"\n" for t in texts))
    return path


def args(inputs, tok, output, *extra):
    return [*map(str, inputs), "--tokenizer", tok, "--output", str(output), "--no-progress", *extra]


def decoded(prefix, tok_path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tok_path)
    ds = open_indexed(str(prefix))
    return [tok.decode(ds[i].tolist()[:-1]) for i in range(len(ds))]


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def hook_first_batch(monkeypatch, action):
    """Run `action()` once, while the run tokenizes its first batch (between start and commit)."""
    real, done = tokenizing.encode_batch, []

    def encode(batch):
        if not done:
            done.append(action())
        return real(batch)

    monkeypatch.setattr(tokenizing, "encode_batch", encode)
    return done


def write_jsonl(path, texts, extra_lines=()):
    """Each text as a JSON line {"text": ..., "id": 1}, then `extra_lines` as they are."""
    with open(path, "wb") as f:
        for t in texts:
            f.write(json.dumps({"text": t, "id": 1}).encode() + b"\n")
        for line in extra_lines:
            f.write(line + b"\n")


def no_temporaries(d) -> bool:
    """Whether directory `d` holds no writer's temporary (`*.tmp-*`)."""
    return not [p for p in os.listdir(d) if ".tmp-" in p]


def write_corpus(d, sizes=(300, 900, 120), seed=0, bad_every=97):
    """JSONL files of random-length documents (one .gz), with a malformed line now and then."""
    import gzip

    rng = random.Random(seed)
    d.mkdir(parents=True, exist_ok=True)
    for k, n in enumerate(sizes):
        lines = []
        for i in range(n):
            lines.append(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 80)))}))
            if i % bad_every == 5:
                lines.append("{not json")
        data = ("\n".join(lines) + "\n").encode()
        if k == 2:
            with gzip.open(d / f"part{k}.jsonl.gz", "wb") as f:
                f.write(data)
        else:
            (d / f"part{k}.jsonl").write_bytes(data)
    return d


def prepare(inputs, tok, output, *extra):
    """data.prepare's command, in this process; its exit code."""
    return cli.main([*map(str, inputs), "--tokenizer", tok, "--output", str(output), "--no-progress", *extra])


def make_shards(root, tok, n, name="web", sizes=(300, 300, 300), seed=0):
    """`n` shards of a write_corpus corpus prepared as root/<name>_shard<i>; returns their prefixes."""
    corpus = write_corpus(root / f"in_{name}", sizes=sizes, seed=seed)
    for i in range(n):
        assert prepare([corpus], tok, root / name, "--shard", f"{i}/{n}") == 0
    return [str(root / f"{name}_shard{i}") for i in range(n)]

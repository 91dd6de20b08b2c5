"""Throughput of ``python -m data.prepare``: ``python -m benchmarks.data_prepare [--mb 16] [--workers 1 2 4]``.

Corpus: natural text every Python install carries, as JSONL (one document per line) and as the
same documents in Parquet -- the standard library's ``.py`` files (code) and ``pydoc_data.topics``
(English prose), repeated to ``--mb`` megabytes. Tokenizers: the demo corpus tokenizer (4,096
byte-level BPE tokens) and a 131,072-token byte-level BPE trained here on a larger sample of the
same text (the vocabulary size of Nemotron-H's tokenizer; not that tokenizer, which is not
shipped by any package). Each run is ``data.prepare`` in-process; its time is the sidecar's
``seconds``: reading, tokenizing and writing, after megatron-core is imported. Prints a Markdown
table with the machine's load average before and after each run (other work on a shared machine
slows the numbers).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Dict, List

from .machine import machine_summary

from data.demo import ensure_demo_corpus
from data.indexed import mcore
from data.prepare import cli
from data.tokenizer import train_bpe_tokenizer
from errors import ExitCode


def _sources() -> List[str]:
    from pydoc_data.topics import topics

    docs = [t for _, t in sorted(topics.items()) if t.strip()]
    lib = Path(sysconfig.get_paths()["stdlib"])
    for p in sorted(lib.rglob("*.py")):
        if "test" in p.parts or "site-packages" in p.parts:
            continue
        try:
            docs.append(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return docs


def write_corpus(d: Path, megabytes: float) -> Dict[str, str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs, out, size = _sources(), [], 0
    while size < megabytes * 1e6:
        for t in docs:
            out.append(t)
            size += len(t.encode("utf-8"))
            if size >= megabytes * 1e6:
                break
    jsonl = d / "corpus.jsonl"
    with open(jsonl, "w", encoding="utf-8") as f:
        for t in out:
            f.write(json.dumps({"text": t}) + "\n")
    parquet = d / "corpus.parquet"
    pq.write_table(pa.table({"text": out}), parquet, row_group_size=1000)
    return {"jsonl": str(jsonl), "parquet": str(parquet)}


def tokenizers(d: Path, cache_dir: str) -> Dict[str, str]:
    demo = ensure_demo_corpus(cache_dir, show_progress=False).tokenizer_path
    big = d / "bpe131072.json"
    t0 = time.time()
    sample, size = _sources(), 0
    for p in sorted(Path(sysconfig.get_paths()["purelib"]).rglob("*.py")):  # + ~70 MB of packages' code
        if size > 70e6:
            break
        sample.append(p.read_text(encoding="utf-8", errors="replace"))
        size += len(sample[-1])
    tok = train_bpe_tokenizer(sample, 131072)
    tok.save(str(big))
    print(f"trained a {tok.get_vocab_size():,}-token BPE on {sum(map(len, sample)) / 1e6:.0f} MB "
          f"in {time.time() - t0:.0f} s", file=sys.stderr)
    return {"demo (4,096)": demo, f"BPE {tok.get_vocab_size():,}": str(big)}


def _cpu_seconds() -> float:
    """CPU time of this process and its reaped children (the pool's workers, joined at the end of
    a run): on a shared machine, tokens per CPU-second is what one worker does on a core of its own."""
    import resource

    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))


def run_one(inp: str, tok: str, out: str, workers: int) -> Dict:
    load0 = os.getloadavg()[0]
    cpu0 = _cpu_seconds()
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):  # only this table on stdout
        rc = cli.main([inp, "--tokenizer", tok, "--output", out, "--workers", str(workers), "--no-progress",
                       "--overwrite"])
    if rc != 0:
        raise SystemExit(f"data.prepare failed ({rc})")
    meta = json.loads(Path(out + ".json").read_text())
    return {"seconds": meta["seconds"], "cpu": _cpu_seconds() - cpu0, "tokens": meta["tokens"],
            "file_bytes": os.path.getsize(inp),
            "text_bytes": meta["bytes"], "load": (load0, os.getloadavg()[0])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.data_prepare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=16.0, help="corpus size in MB of text")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--cache-dir", default=os.path.join(os.environ.get("NVFP4_CACHE", ".cache"), "data"))
    args = ap.parse_args(argv)
    mcore()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        inputs = write_corpus(d, args.mb)
        toks = tokenizers(d, args.cache_dir)
        rows = []
        for tname, tok in toks.items():
            for fmt, inp in inputs.items():
                for w in (args.workers if fmt == "jsonl" else [1]):
                    r = run_one(inp, tok, str(d / f"out_{fmt}"), w)
                    rows.append((tname, fmt, w, r))
                    print(f"{tname} {fmt} workers={w}: {r}", file=sys.stderr, flush=True)
    print(f"\n{machine_summary()}; corpus {args.mb:g} MB of text\n")
    print("| tokenizer | input | workers | wall s | MB/s (file) | tokens/s | tokens/s per worker | "
          "CPU s | tokens per CPU-s | bytes/token | load avg before -> after |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for tname, fmt, w, r in rows:
        s = r["seconds"]
        print(f"| {tname} | {fmt} | {w} | {s:.1f} | {r['file_bytes'] / s / 1e6:.2f} | {r['tokens'] / s:,.0f} | "
              f"{r['tokens'] / s / w:,.0f} | {r['cpu']:.1f} | {r['tokens'] / r['cpu']:,.0f} | "
              f"{r['text_bytes'] / r['tokens']:.2f} | {r['load'][0]:.1f} -> {r['load'][1]:.1f} |")
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())

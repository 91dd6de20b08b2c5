"""Benchmark of the data loader: ``python -m benchmarks.data_loader [--model-tokens-per-sec 2000]``.

1. Loader throughput on the demo recipe (seq 256): samples/s and tokens/s of
   ``next_global_batch`` versus what a demo model consumes (``--model-tokens-per-sec``).
2. Memory of the blend state for ``recipes/data/phased_10t.yaml`` (10T tokens, seq 8192, 9
   sources synthesized as tiny fake datasets in a temp dir) versus the demo recipe: Python heap
   allocations made by ``build_data`` + the first batch (tracemalloc; numpy arrays included),
   RSS growth, the schedule tables' bytes, and the pickled ``state_dict`` size. Each measurement
   runs in a fresh process.
3. Time to locate global sample 1,000,000,000 of the 10T schedule (phase, source, the source's
   count): closed-form arithmetic, no iteration; and to read that sample.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pickle
import tempfile
import time
import tracemalloc
import warnings
from pathlib import Path
from typing import Dict

import numpy as np

from data.config import to_data_config
from data.demo import ensure_demo_corpus
from data.indexed import mcore
from data.tokenizer import train_bpe_tokenizer
from errors import ExitCode

RECIPES = Path(__file__).resolve().parents[1] / "recipes" / "data"


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _load_recipe(name: str, cache_dir: str):
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(RECIPES / f"{name}.yaml")
    cfg.cache_dir = cache_dir
    return to_data_config(cfg)


def synthesize_10t(root: str) -> None:
    """Tiny fake datasets (random tokens) at every prefix of phased_10t.yaml under DATA_ROOT=root."""
    os.environ["DATA_ROOT"] = root
    cfg = _load_recipe("phased_10t", os.path.join(root, "cache"))
    tok = train_bpe_tokenizer(["tiny fake corpus for the benchmark"] * 10, 300)
    tok.save(cfg.tokenizer)
    rng = np.random.default_rng(0)
    prefixes = [p for c in cfg.categories.values() for p in c.prefixes]
    prefixes += [p for ps in cfg.validation.values() for p in ps]
    for p in prefixes:
        os.makedirs(os.path.dirname(p), exist_ok=True)
        b = mcore().IndexedDatasetBuilder(p + ".bin", dtype=np.uint16)
        for _ in range(200):
            ids = np.append(rng.integers(1, 300, int(rng.integers(100, 500))), 0).astype(np.uint16)
            b.add_document(ids, [len(ids)])
        b.finalize(p + ".idx")


def _measure(kind: str, cache_dir: str, data_root: str, q) -> None:
    warnings.simplefilter("ignore")
    os.environ["DATA_ROOT"] = data_root
    # deferred: build_data loads torch (data keeps it lazy), and this function runs in a spawned
    # process that re-imports this module: it loads it here, after DATA_ROOT and the warnings filter
    from data import build_data

    mcore()
    import torch  # noqa: F401

    seq, gbs = (256, 32) if kind == "demo" else (8192, 736)
    cfg = _load_recipe(kind, cache_dir)
    total = cfg.total_tokens or 200 * gbs * seq
    rss0 = _rss_bytes()
    tracemalloc.start()
    bundle = build_data(cfg, seq_length=seq, micro_batch_size=1 if kind != "demo" else 8, global_batch_size=gbs,
                        total_tokens=total, seed=0, dp_rank=0, dp_size=1 if kind == "demo" else 736 // 1,
                        show_progress=False)
    bundle.train.next_global_batch()
    heap, _peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss1 = _rss_bytes()
    out = {
        "sources": len(bundle.train.sources),
        "phases": len(bundle.train.schedule.phases),
        "periods": [p.interleave.period for p in bundle.train.schedule.phases],
        "total_samples": bundle.train.schedule.total_samples,
        "heap": heap,
        "rss": rss1 - rss0,
        "schedule_bytes": bundle.train.schedule.nbytes(),
        "state_bytes": len(pickle.dumps(bundle.train.state_dict())),
    }
    if kind != "demo":
        sch = bundle.train.schedule
        n = 1_000_000_000
        t = time.perf_counter()
        for _ in range(1000):
            loc = sch.locate(n)
        out["locate_us"] = (time.perf_counter() - t) / 1000 * 1e6
        out["locate"] = loc
        out["locate_source"] = bundle.train.sources[loc[1]].key
        t = time.perf_counter()
        bundle.train.sample(n)
        out["sample_ms"] = (time.perf_counter() - t) * 1e3
    q.put(out)


def _in_fresh_process(kind: str, cache_dir: str, data_root: str) -> Dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_measure, args=(kind, cache_dir, data_root, q))
    p.start()
    out = q.get(timeout=600)
    p.join()
    return out


def throughput(cache_dir: str, seq: int, mbs: int, gbs: int, batches: int) -> Dict:
    from data import build_data  # deferred: torch, as in _measure

    cfg = _load_recipe("demo", cache_dir)
    t = time.perf_counter()
    corpus = ensure_demo_corpus(os.path.abspath(cache_dir), cfg.demo, show_progress=True)
    prep_s = time.perf_counter() - t
    mcore()
    t = time.perf_counter()
    bundle = build_data(cfg, seq_length=seq, micro_batch_size=mbs, global_batch_size=gbs,
                        total_tokens=batches * gbs * seq, seed=0, show_progress=True)
    build_s = time.perf_counter() - t
    bundle.train.next_global_batch()  # warm-up (first epoch indices)
    t = time.perf_counter()
    for _ in range(batches):
        bundle.train.next_global_batch()
    dt = time.perf_counter() - t
    return {"prep_s": prep_s, "prep_built": corpus.built, "build_s": build_s, "samples_per_s": batches * gbs / dt, "tokens_per_s": batches * gbs * seq / dt}


def main(argv=None) -> int:
    warnings.simplefilter("ignore")
    from rich.console import Console
    from rich.table import Table

    ap = argparse.ArgumentParser(prog="python -m benchmarks.data_loader", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-tokens-per-sec", type=float, default=2000.0,
                    help="what the demo model consumes (tokens/s), to compare the loader against")
    ap.add_argument("--cache-dir", default=os.path.join(os.environ.get("NVFP4_CACHE", ".cache"), "data"))
    ap.add_argument("--batches", type=int, default=100)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--global-batch-size", type=int, default=32)
    args = ap.parse_args(argv)
    con = Console()

    thr = throughput(args.cache_dir, 256, args.micro_batch_size, args.global_batch_size, args.batches)
    with tempfile.TemporaryDirectory() as root:
        synthesize_10t(root)
        demo = _in_fresh_process("demo", args.cache_dir, root)
        big = _in_fresh_process("phased_10t", os.path.join(root, "cache"), root)

    t = Table(title="benchmarks.data_loader (CPU)")
    t.add_column("measure")
    t.add_column("value", justify="right")
    t.add_column("note")
    t.add_row("loader, demo, seq 256", f"{thr['samples_per_s']:,.0f} samples/s",
              f"{thr['tokens_per_s']:,.0f} tokens/s; mbs {args.micro_batch_size}, gbs {args.global_batch_size}")
    need = args.model_tokens_per_sec
    t.add_row("demo model consumes", f"{need / 256:,.1f} samples/s",
              f"{need:,.0f} tokens/s -> loader headroom x{thr['tokens_per_s'] / need:,.0f}")
    t.add_row("demo corpus preparation", f"{thr['prep_s']:.2f} s",
              "built now (tokenizer + 6 datasets)" if thr["prep_built"] else "cache hit (hash of inputs + settings)")
    t.add_row("build_data (demo, corpus cached)", f"{thr['build_s']:.2f} s", "after megatron-core is imported")
    for name, m in (("demo", demo), ("phased_10t", big)):
        t.add_row(f"blend memory, {name}", f"{m['heap'] / 2**20:.2f} MiB",
                  f"heap (tracemalloc) of build_data + 1 batch (10T: rank 0 of DP 736); RSS +{m['rss'] / 2**20:.1f} MiB; "
                  f"{m['sources']} sources, {m['phases']} phases, periods {m['periods']}")
        t.add_row(f"schedule tables / state, {name}", f"{m['schedule_bytes'] / 1024:.1f} KiB",
                  f"state_dict {m['state_bytes']} bytes pickled; run = {m['total_samples']:,} samples")
    t.add_row("locate sample 1,000,000,000 (10T)", f"{big['locate_us']:.1f} us",
              f"-> phase {big['locate'][0]}, source {big['locate_source']}, its sample #{big['locate'][2]:,}")
    t.add_row("read sample 1,000,000,000 (10T)", f"{big['sample_ms']:.1f} ms", "incl. building that epoch's indices")
    con.print(t)
    return ExitCode.OK


if __name__ == "__main__":
    raise SystemExit(main())

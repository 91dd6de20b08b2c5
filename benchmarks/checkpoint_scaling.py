"""Checkpoint save/load per data-parallel rank: peak RSS and time (docs/benchmarks/checkpoint-scaling.md).

    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 \
        -m benchmarks.checkpoint_scaling [--hidden 1024] [--layout dp_reshardable]
    .venv/bin/python -m benchmarks.checkpoint_scaling --hashing [--file-mib 1024]

`--hashing` (one process, no torch.distributed): the SHA-256 throughput of the checkpoint's own
hashing (training/checkpoint.py:_hash_files) over freshly written files, in the page cache as a
rank's own files are right after it wrote them: one file on one thread, and 2 and 4 files on as
many threads; then the 12B projection of the hashing a save and a resume add per rank, before
(rank 0 hashed every file, alone) and after (each rank its own), at one replica and at the
paper's layout (`projection`, a pure function of the measured rate).

Each rank builds the model and the sharded optimizer (the CPU twin of megatron's distributed
optimizer, `trainer.distributed_optimizer=true`), takes one Adam step so both moments exist, saves
a checkpoint through training/checkpoint.py and loads it into a freshly built model and optimizer.
Per rank and per phase: wall time and the peak RSS the phase added over the RSS it started at
(the kernel's high-water mark, reset before each phase by writing 5 to /proc/self/clear_refs).
Rank 0 prints one JSON line. The same script runs against an older checkout (the "before"
rows): it passes only the keywords that checkout's save_checkpoint/load_checkpoint take.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import tempfile
import time
from pathlib import Path

from model.build import build_model
from model.config import ModelConfig
from nvfp4_recipe.policy import PrecisionConfig
from training import checkpoint as ckpt
from training import ddp_optimizer as mp
from training.config import TrainerConfig
from training.distributed import init_distributed, shutdown


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _measure(fn):
    """(result, seconds, MiB the phase's peak RSS rose above its starting RSS)."""
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM to the current RSS
        f.write("5")
    start_rss = _status_kib("VmRSS")
    started = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - started
    return result, seconds, (_status_kib("VmHWM") - start_rss) / 1024


def _keywords(fn, **wanted):
    params = inspect.signature(fn).parameters
    return {k: v for k, v in wanted.items() if k in params}


# The 12B model (notes: nemotron-h-12b.md): 12.31B parameters; a checkpoint holds BF16 weights
# (2 bytes) and the FP32 master weights and both Adam moments (3 x 4 bytes) of each.
PARAMS_12B = 12.31e9
WEIGHT_BYTES, OPTIMIZER_BYTES = 2, 12
# One replica (data parallel 1) on one rank and on a GB200 node's 4 GPUs (tensor 4), and the
# paper's layout, recipes/experiment/nemotron_h_12b_nvfp4_10t.yaml: tensor 4 x data 184.
LAYOUTS = {"DP=1, one rank": (1, 1), "DP=1, TP=4": (4, 1), "paper, TP=4 x DP=184": (4, 184)}


def per_rank_bytes(params: float, tensor: int, data: int) -> float:
    """Bytes of a checkpoint one rank writes: its tensor shard's optimizer state split over the
    data-parallel ranks (dp_reshardable) and its share of the BF16 weights, which megatron's
    fully-parallel save spreads over the data-parallel replicas (the shared metadata is small)."""
    return params * (WEIGHT_BYTES + OPTIMIZER_BYTES) / (tensor * data)


def projection(rate_one: float, rate_threads: float, files_per_rank: int = 3) -> list[dict]:
    """Seconds of hashing a 12B save (and a resume's verification, the same bytes) adds per
    rank, at `rate_one` bytes/s on one thread and `rate_threads` on a rank's few files at once.
    Before: rank 0 hashed the whole checkpoint on one thread while every other rank waited in
    the next collective; after: each rank hashes what it wrote (its 2 torch_dist files, megatron's
    writer thread_count, and its RNG file), so the slowest rank's share is the wait."""
    total = PARAMS_12B * (WEIGHT_BYTES + OPTIMIZER_BYTES)
    rows = []
    for name, (tensor, data) in LAYOUTS.items():
        own = per_rank_bytes(PARAMS_12B, tensor, data)
        rows.append({"layout": name, "ranks": tensor * data, "checkpoint_gb": round(total / 1e9, 1),
                     "per_rank_gb": round(own / 1e9, 3),
                     "before_s": round(total / rate_one, 1),
                     "after_s": round(own / (rate_threads if files_per_rank > 1 else rate_one), 1)})
    return rows


def hashing(file_mib: int) -> None:
    """Measure the checkpoint's hashing throughput here and print it with the 12B projection."""
    import shutil
    import subprocess

    work = Path(tempfile.mkdtemp(prefix="hash-bench-"))
    size = file_mib << 20
    try:
        block = os.urandom(1 << 20)
        for i in range(4):
            with open(work / f"__{i}_0.distcp", "wb") as f:
                for _ in range(file_mib):
                    f.write(block)
        ckpt._hash_files(work, [f"__{i}_0.distcp" for i in range(4)])  # into the page cache
        rates = {}
        for files in (1, 2, 4):
            names = [f"__{i}_0.distcp" for i in range(files)]
            ckpt.HASH_THREADS = files
            best = None
            for _ in range(3):  # best of 3: the machine is shared
                started = time.perf_counter()
                ckpt._hash_files(work, names)
                seconds = time.perf_counter() - started
                best = seconds if best is None else min(best, seconds)
            rates[files] = files * size / best
    finally:
        shutil.rmtree(work, ignore_errors=True)
    model = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines()
        if line.startswith("Model name")), "?")
    flags = open("/proc/cpuinfo").read()
    print(json.dumps({
        "cpu": model, "cpus": os.cpu_count(), "sha_ni": " sha_ni" in flags,
        "load_average": [round(x, 2) for x in os.getloadavg()], "file_mib": file_mib,
        "mb_per_s": {f"{n} file(s), {n} thread(s)": round(r / 1e6) for n, r in rates.items()},
        "projection_12b": projection(rates[1], rates[2])}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--pattern", default="M-M-M*-M-")
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--layout", default="dp_reshardable",
                        help="optimizer layout for checkouts that have one")
    parser.add_argument("--dir", default=None, help="where the checkpoint goes (default: a "
                        "temporary directory, removed afterwards)")
    parser.add_argument("--hashing", action="store_true", help="measure SHA-256 throughput "
                        "(one process) and project the 12B save/resume hashing per rank")
    parser.add_argument("--file-mib", type=int, default=1024, help="--hashing: MiB per file")
    args = parser.parse_args()
    if args.hashing:
        return hashing(args.file_mib)

    import torch
    import torch.distributed as dist

    ctx = init_distributed(1, 1, "gloo")
    model_cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                            ffn_hidden_size=4 * args.hidden, pattern=args.pattern,
                            num_attention_heads=8, num_query_groups=8,
                            kv_channels=args.hidden // 8, mamba_num_heads=args.hidden // 32,
                            mamba_head_dim=64)
    trainer_cfg = TrainerConfig(distributed_optimizer=True)

    def build():
        torch.manual_seed(0)
        core = build_model(model_cfg, PrecisionConfig(name="bf16", format="bf16"),
                           vocab_size=args.vocab, backend="emulated",
                           params_dtype=mp.PARAMS_DTYPE).module
        _, optimizer = mp.build_data_parallel_model(core, trainer_cfg, ctx)
        return core, optimizer

    core, optimizer = build()
    for buffer in optimizer.model.buffers:
        buffer.grad_data.normal_()
    optimizer.step()  # both Adam moments exist
    fmt = mp.optimizer_checkpoint_format(ctx.device, True)
    params = sum(p.numel() for p in core.parameters())
    root = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-bench-"))
    root = Path(ckpt._broadcast_str(str(root), ctx))

    save_kw = _keywords(ckpt.save_checkpoint, optimizer_layout=args.layout)
    path, save_s, save_mib = _measure(lambda: ckpt.save_checkpoint(
        root, 1, ctx, model=core, optimizer=optimizer, optimizer_format=fmt,
        trainer_state={"step": 1}, keep_last=0, **save_kw))
    del core, optimizer
    core, optimizer = build()
    _, load_s, load_mib = _measure(lambda: ckpt.load_checkpoint(path, ctx, core, optimizer, fmt))
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    row = {"rank": ctx.rank, "save_s": round(save_s, 2), "save_peak_mib": round(save_mib),
           "load_s": round(load_s, 2), "load_peak_mib": round(load_mib)}
    rows = [None] * ctx.world_size
    dist.all_gather_object(rows, row)
    if ctx.is_main:
        total = sum(f.stat().st_size for f in (path / "dist").rglob("*") if f.is_file())
        print(json.dumps({
            "params": params, "optimizer_state_mib": round(params * 12 / 2**20),
            "layout": manifest.get("optimizer_layout", "fully_reshardable"),
            "dist_mib": round(total / 2**20), "ranks": rows}))
        if args.dir is None:
            import shutil

            shutil.rmtree(root, ignore_errors=True)
    shutdown()


if __name__ == "__main__":
    from compat import quiet_cpu_fallback_warnings

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    quiet_cpu_fallback_warnings()
    main()

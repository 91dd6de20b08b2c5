"""Checkpoint save/load per data-parallel rank: peak RSS and time (docs/benchmarks/checkpoint-scaling.md).

    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 \
        -m benchmarks.checkpoint_scaling [--hidden 1024] [--layout dp_reshardable]

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--pattern", default="M-M-M*-M-")
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--layout", default="dp_reshardable",
                        help="optimizer layout for checkouts that have one")
    parser.add_argument("--dir", default=None, help="where the checkpoint goes (default: a "
                        "temporary directory, removed afterwards)")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    from model.build import build_model
    from model.config import ModelConfig
    from nvfp4_recipe.policy import PrecisionConfig
    from training import checkpoint as ckpt
    from training import ddp_optimizer as mp
    from training.config import TrainerConfig
    from training.distributed import init_distributed, shutdown

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
    optimizer.model.grad_data.normal_()
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

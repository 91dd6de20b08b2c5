"""Data: demo corpus, tokenizer, preparation CLI, phase schedule and the streaming blend.

Knows nothing of precision or the model. Entry points::

    from data import DataConfig, build_data
    bundle = build_data(cfg, seq_length=..., micro_batch_size=..., global_batch_size=...,
                        total_tokens=..., seed=..., dp_rank=..., dp_size=..., show_progress=...)

The demo corpus (demo.py) is built from a snapshot of CPython 3.11.7's texts
(demo_snapshot.py, demo_corpus/), the same on every Python version. ``python -m data.prepare`` tokenizes JSONL/text/Parquet/Arrow into megatron-core indexed datasets
(whole, or one ``--shard I/N`` of a Slurm array);
``python -m benchmarks.data_loader`` measures the loader. ``import data`` stays light: torch and
megatron-core load on first use of ``build_data``.
"""

from data.config import (
    CategoryConfig,
    DataConfig,
    DataConfigError,
    DemoConfig,
    MissingDataError,
    PhaseConfig,
    validate_config,
)

__all__ = [
    "CategoryConfig", "DataConfig", "DataConfigError", "DemoConfig", "MissingDataError", "PhaseConfig",
    "validate_config", "build_data", "DataBundle", "StreamingBlend",
]


def __getattr__(name):  # PEP 562: lazy heavy imports
    if name in ("build_data", "DataBundle"):
        from data import build as _b  # deferred: torch; `import data` stays light

        return getattr(_b, name)
    if name == "StreamingBlend":
        from data.blend import StreamingBlend  # deferred: torch, as build_data

        return StreamingBlend
    raise AttributeError(f"module 'data' has no attribute {name!r}")

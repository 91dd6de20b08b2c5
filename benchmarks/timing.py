"""Timing for the benches: interleaved medians (load from other processes hits every case alike),
accumulated time of wrapped functions, GEMM throughput, and the Markdown table of the results."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from model.device import cuda_present


def _synchronize() -> None:
    if cuda_present():
        torch.cuda.synchronize()


def measure_interleaved(fns: dict[str, Callable[[], object]], warmup: int = 1, repeats: int = 5) -> dict[str, float]:
    """Median seconds per fn, timing the fns round-robin so that load from other processes on a
    shared machine hits all of them alike (ratios stay meaningful when absolute times drift)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            _synchronize()
            start = time.perf_counter()
            fn()
            _synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def gemm_tflops(m: int, k: int, n: int, seconds: float) -> float:
    """Throughput of an (m x k) @ (k x n) GEMM, counting 2*m*k*n FLOPs."""
    return 2.0 * m * k * n / seconds / 1e12


class SectionTimer:
    """Accumulated wall time of wrapped functions (synchronizing CUDA around each call), e.g. to
    find the share of a training step spent in the quantizers. Not re-entrant-safe across threads."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._depth = 0

    def wrap(self, name: str, fn: Callable) -> Callable:
        def wrapped(*args, **kwargs):
            if self._depth:  # nested wrapped calls count once, in the outermost
                return fn(*args, **kwargs)
            self._depth += 1
            _synchronize()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _synchronize()
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
                self.calls[name] = self.calls.get(name, 0) + 1
                self._depth -= 1

        return wrapped

    def total(self) -> float:
        return sum(self.seconds.values())


def format_table(rows: list[dict[str, object]], columns: list[str]) -> str:
    """A Markdown table of `rows` (dicts) restricted to `columns`."""
    def cell(value: object) -> str:
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)

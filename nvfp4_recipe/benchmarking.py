"""Small timing helpers shared by the numerics bench (and a later all-hardware bench)."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from typing import Callable

import torch


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(fn: Callable[[], object], warmup: int = 1, repeats: int = 5) -> float:
    """Median wall time of fn() in seconds, after `warmup` untimed calls (CUDA synchronized)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _synchronize()
        start = time.perf_counter()
        fn()
        _synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


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


def cpu_model() -> str:
    """The CPU model name (lscpu, /proc/cpuinfo, or platform)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def hardware_info() -> dict[str, object]:
    """What the numbers were measured on."""
    info: dict[str, object] = {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(),
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    return info


def format_table(rows: list[dict[str, object]], columns: list[str]) -> str:
    """A Markdown table of `rows` (dicts) restricted to `columns`."""
    def cell(value: object) -> str:
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)

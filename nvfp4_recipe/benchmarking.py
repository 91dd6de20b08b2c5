"""Timing helpers shared by the benches: interleaved medians, what the machine is, and how loaded it was."""

from __future__ import annotations

import contextlib
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

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


# -- additions for the all-hardware bench (launch/bench.py); the functions above are unchanged --

# Dense (no sparsity) BF16 tensor-core peaks in TFLOP/s, matched by substring of the CUDA device
# name, most specific first. Sources: NVIDIA H100/H200 datasheets (SXM: 1,979 TFLOP/s "with
# sparsity" = 989 dense; H100 PCIe 756 dense), the DGX B200 / GB200 NVL72 datasheets (B200 2.25
# PFLOP/s, GB200 2.5 PFLOP/s dense BF16 per GPU), A100 datasheet (312). B300 / GB300: NVIDIA's
# Blackwell Ultra material quotes the same dense BF16 rate as GB200 (its gains are in FP4); 2500 is
# an assumption, flagged as such in the output.
BF16_DENSE_PEAK_TFLOPS: tuple[tuple[str, float, str], ...] = (
    ("GB300", 2500.0, "assumed = GB200 (Blackwell Ultra adds FP4, not BF16, throughput); unsure"),
    ("B300", 2500.0, "assumed = GB200 (Blackwell Ultra adds FP4, not BF16, throughput); unsure"),
    ("GB200", 2500.0, "NVIDIA GB200 NVL72 datasheet, dense BF16 per GPU"),
    ("B200", 2250.0, "NVIDIA DGX B200 datasheet, dense BF16 per GPU"),
    ("H200", 989.0, "NVIDIA H200 SXM datasheet (1,979 with sparsity)"),
    ("H100 PCIe", 756.0, "NVIDIA H100 PCIe datasheet, dense BF16"),
    ("H100", 989.0, "NVIDIA H100 SXM datasheet (1,979 with sparsity)"),
    ("H800", 989.0, "assumed = H100 SXM"),
    ("A100", 312.0, "NVIDIA A100 datasheet, dense BF16"),
)


def bf16_peak_tflops(device_name: str | None) -> tuple[float | None, str]:
    """(dense BF16 peak in TFLOP/s, source note) for a CUDA device name; (None, why) if unknown."""
    if not device_name:
        return None, "no CUDA device: no tensor-core peak (MFU not reported on CPU)"
    upper = device_name.upper()
    for key, peak, source in BF16_DENSE_PEAK_TFLOPS:
        if key.upper() in upper:
            return peak, f"{key}: {source}"
    return None, f"no known BF16 peak for {device_name!r} (add it to BF16_DENSE_PEAK_TFLOPS)"


def gemm_tflops(m: int, k: int, n: int, seconds: float) -> float:
    """Throughput of an (m x k) @ (k x n) GEMM, counting 2*m*k*n FLOPs."""
    return 2.0 * m * k * n / seconds / 1e12


def load_average() -> tuple[float, float, float] | None:
    """The 1/5/15-minute load averages (None where the OS has none)."""
    return tuple(round(x, 2) for x in os.getloadavg()) if hasattr(os, "getloadavg") else None


def transformer_engine_info() -> dict[str, object]:
    """Whether Transformer Engine imports here, and its version (never raises)."""
    try:
        import transformer_engine  # noqa: F401
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # ImportError, or OSError for missing CUDA libraries
        return {"importable": False, "version": None, "error": f"{type(exc).__name__}: {exc}"[:200]}
    version = getattr(transformer_engine, "__version__", None)
    if version is None:
        try:
            from importlib.metadata import version as dist_version

            version = dist_version("transformer_engine")
        except Exception:
            version = "unknown"
    return {"importable": True, "version": str(version), "error": None}


def device_info() -> dict[str, object]:
    """hardware_info() plus the CUDA runtime, compute capability, memory, Transformer Engine and
    the known BF16 peak: everything a bench result must be reported with."""
    info = hardware_info()
    info["load_average"] = load_average()
    info["cuda_available"] = torch.cuda.is_available()
    info["cuda_runtime"] = torch.version.cuda
    gpu_name = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu_name = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["gpu_count"] = torch.cuda.device_count()
    peak, source = bf16_peak_tflops(gpu_name)
    info["bf16_peak_tflops"] = peak
    info["bf16_peak_source"] = source
    info["transformer_engine"] = transformer_engine_info()
    return info


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


# -- machine load: every bench reports it, and marks ratios measured under load ------------------

# Other processes using more than this many CPUs on average make a run "loaded": on the 2-core dev
# VM a quarter core of foreign work already moves the emulation's ratios by several percent.
LOADED_OTHER_CPUS = 0.25


def _busy_cpu_seconds() -> float | None:
    """CPU seconds all processes have spent busy since boot (/proc/stat), None where unavailable."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except (OSError, IndexError):
        return None
    jiffies = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
    busy = sum(jiffies) - jiffies[3] - jiffies[4]  # steal counts: the hypervisor took the CPU
    return busy / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass
class LoadReport:
    """What else ran while a bench ran: the load averages at its start and end, and the CPUs that
    other processes kept busy on average (all CPUs' busy time minus this process's, over wall time)."""

    load_start: tuple[float, float, float] | None
    load_end: tuple[float, float, float] | None
    other_cpus: float | None
    seconds: float

    @property
    def loaded(self) -> bool | None:
        return None if self.other_cpus is None else self.other_cpus > LOADED_OTHER_CPUS

    def line(self) -> str:
        """One line for a report: idle or LOADED, and the evidence."""
        averages = (f"load average (1/5/15 min) {' '.join(map(str, self.load_start or ()))} at start, "
                    f"{' '.join(map(str, self.load_end or ()))} at end")
        if self.other_cpus is None:
            return f"machine load unknown (no /proc/stat); {averages}"
        state = ("LOADED: ratios measured under load, not comparable to idle runs" if self.loaded
                 else "idle")
        return (f"{state} (other processes used {self.other_cpus:.2f} CPUs on average over "
                f"{self.seconds:.0f} s; {averages})")

    def to_json(self) -> dict[str, object]:
        return {"load_average_start": self.load_start, "load_average_end": self.load_end,
                "other_cpus": None if self.other_cpus is None else round(self.other_cpus, 3),
                "loaded": self.loaded, "seconds": round(self.seconds, 1)}


class MachineLoad:
    """`with MachineLoad() as load: ...` then `load.report`, or `start()` ... `stop()` -> LoadReport."""

    report: LoadReport | None = None

    def start(self) -> "MachineLoad":
        self._start = (load_average(), _busy_cpu_seconds(), _own_cpu_seconds(), time.perf_counter())
        return self

    def stop(self) -> LoadReport:
        load_start, busy_start, own_start, wall_start = self._start
        busy_end, own_end, wall = _busy_cpu_seconds(), _own_cpu_seconds(), time.perf_counter() - wall_start
        other = None
        if busy_start is not None and busy_end is not None and wall > 0:
            other = max(0.0, (busy_end - busy_start) - (own_end - own_start)) / wall
        self.report = LoadReport(load_start, load_average(), other, wall)
        return self.report

    def __enter__(self) -> "MachineLoad":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


_LOAD_LOOP = ("import torch; torch.set_num_threads(1); a = torch.randn(512, 512, dtype=torch.bfloat16)\n"
              "while True: a @ a")


@contextlib.contextmanager
def background_load(processes: int) -> Iterator[None]:
    """Run `processes` single-threaded BF16 matmul loops beside the block (another job on the
    machine), to measure what the emulation costs on a busy machine; stopped on exit."""
    procs = [subprocess.Popen([sys.executable, "-c", _LOAD_LOOP], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for _ in range(processes)]
    try:
        if procs:
            time.sleep(2.0)  # let them import torch and start multiplying
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()

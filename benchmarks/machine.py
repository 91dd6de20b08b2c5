"""What a bench ran on and how busy the machine was: every bench reports both.

`hardware_info()` (CPU, threads, torch, Python, GPU) and `device_info()` (that plus CUDA, GPU
memory, Transformer Engine and the known dense BF16 peak) are the one description of a machine;
`MachineLoad` measures the CPU time other processes took while a bench ran and marks its ratios
LOADED; `background_load` makes a busy machine on purpose.
"""

from __future__ import annotations

import contextlib
import os
import platform
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from model.device import cuda_present, probe_hardware


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
    """What the numbers were measured on: the machine, and the device decision of a run on it
    (model/device.py: the CPU's ISA, whether its BF16 GEMMs are native, what GEMMs compute in)."""
    hardware = probe_hardware()
    cpu = probe_hardware("cpu")
    info: dict[str, object] = {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cpu_capability": cpu.cpu_isa,
        "cpu_bf16_gemms_native": cpu.bf16_gemms_native,
        "cpu_gemm_compute": cpu.gemm_compute().describe(),
        "python": platform.python_version(),
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    if hardware.cuda:
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_capability"] = ".".join(map(str, hardware.cuda_capability))
    return info


def machine_summary(info: dict[str, object] | None = None) -> str:
    """One line for a report: CPU, threads, torch, Python and the GPU, from hardware_info()."""
    info = info or hardware_info()
    line = (f"{info['cpu']}, {info['cpu_count']} logical CPUs ({info['cpu_capability']}, "
            f"{'native' if info['cpu_bf16_gemms_native'] else 'no'} BF16 GEMMs), torch "
            f"{info['torch']} ({info['torch_threads']} threads), Python {info['python']}")
    return line + (f", {info['gpu']} (sm {info['gpu_capability']})" if "gpu" in info else "")


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
    info["cuda_available"] = cuda_present()
    info["cuda_runtime"] = torch.version.cuda
    gpu_name = None
    if cuda_present():
        props = torch.cuda.get_device_properties(0)
        gpu_name = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["gpu_count"] = torch.cuda.device_count()
    peak, source = bf16_peak_tflops(gpu_name)
    info["bf16_peak_tflops"] = peak
    info["bf16_peak_source"] = source
    info["transformer_engine"] = transformer_engine_info()
    return info


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

"""The one device decision: where a run computes and what that device offers.

`probe_hardware(device)` reads the machine once per device into a `Hardware`, a plain value that
every choice depending on the device reads: the process-group backend, megatron's RNG seeding and
CPU patches (compat.py), the layer spec and GEMM backend (model/backend.py), the Mamba kernels,
the RNG state a checkpoint keeps, the GEMM compute policy (nvfp4_recipe/compute.py) and what the
benches report. The device is the run's (the parallel context's), never "is some GPU present":
a gloo run on a machine with a GPU is a CPU run. Tests state any machine as a `Hardware`.

Whether BF16 GEMMs are native on a CPU is nvfp4_recipe.compute's probe (`cpu_bf16_gemms_native`,
cached there, so the library's emulated GEMMs and the run read one decision): oneDNN must take
BF16 GEMMs (`torch.ops.mkldnn._is_mkldnn_bf16_supported`, the check torch makes before it hands a
BF16 GEMM to oneDNN; without it torch runs a generic kernel: a Zen 3, AVX2, `F.linear` 1024x256 x
256x1024 in 82 ms BF16 vs 12 ms FP32), and on x86 the CPU must have BF16 instructions (AVX512-BF16
or AMX): on AVX-512 without them oneDNN emulates BF16 (an Intel Xeon: 9.2 ms vs 1.6 ms). It follows
`ONEDNN_MAX_CPU_ISA`, so `ONEDNN_MAX_CPU_ISA=AVX2` reproduces such a CPU on a newer one
(docs/performance.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from nvfp4_recipe.compute import GemmCompute, cpu_bf16_gemms_native, gemm_compute, tf32_matmuls


@dataclass(frozen=True)
class Hardware:
    """The run's device and what it offers (plain values)."""

    device_type: str  # "cuda" | "cpu": the run's device
    cuda_capability: Optional[tuple[int, int]]  # the run's GPU; None on a CPU run
    cpu_isa: str  # torch's CPU kernel level: "AVX512", "AVX2", "DEFAULT", "SVE256", ...
    bf16_gemms_native: bool  # a CUDA device, or a CPU whose BF16 GEMMs oneDNN runs natively

    @property
    def cuda(self) -> bool:
        return self.device_type == "cuda"

    def describe(self) -> str:
        if self.cuda:
            major, minor = self.cuda_capability
            return f"CUDA, compute capability {major}.{minor}"
        native = "native BF16 GEMMs" if self.bf16_gemms_native else "no BF16 instructions"
        return f"CPU {self.cpu_isa}, {native}"

    def gemm_compute(self, requested: str = "auto") -> GemmCompute:
        """What BF16 GEMMs compute in on this device (`precision.gemm_compute`)."""
        isa = (f"compute capability {self.cuda_capability[0]}.{self.cuda_capability[1]}"
               if self.cuda else self.cpu_isa)
        return gemm_compute(requested, self.device_type, self.bf16_gemms_native, isa,
                            tf32=self.cuda and tf32_matmuls())


def cuda_present() -> bool:
    """Whether this process sees a GPU: only to choose the default device and process-group
    backend (`parallel.backend=auto`). Every later choice reads the run's `Hardware`."""
    return torch.cuda.is_available()


@functools.cache
def _probe(device_type: str, index: Optional[int]) -> Hardware:
    capability = torch.cuda.get_device_capability(index) if device_type == "cuda" else None
    native = device_type == "cuda" or cpu_bf16_gemms_native()
    return Hardware(device_type=device_type, cuda_capability=capability,
                    cpu_isa=torch.backends.cpu.get_cpu_capability(), bf16_gemms_native=native)


def probe_hardware(device: torch.device | str | None = None) -> Hardware:
    """`device`'s Hardware (probed once per device). None: the device a run would default to."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if cuda_present() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _probe(device.type, device.index)

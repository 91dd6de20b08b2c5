"""Wall time per labelled part of a step, for `benchmarks/step_profile.py` (issue 16, item 1).

torch.profiler charges ~10 us to every op, and the emulated GEMMs run many small ops: under it
an NVFP4 step took 7.7x longer than without it, so its split says more about the profiler than
about the step. These timers cost ~1 us per labelled region and nothing when no timer is active.
A region's time excludes the labelled regions nested in it (the innermost label owns the time).
Labels inside autograd Functions time the backward too (CPU autograd runs on the caller's thread).
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator, Optional

_active: Optional["PartTimer"] = None


class PartTimer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._children: list[float] = []  # per open region: time spent in nested regions

    def __enter__(self) -> "PartTimer":
        global _active
        if _active is not None:
            raise RuntimeError("a PartTimer is already active")
        _active = self
        return self

    def __exit__(self, *exc) -> None:
        global _active
        _active = None


@contextmanager
def part(name: str) -> Iterator[None]:
    timer = _active
    if timer is None:
        yield
        return
    timer._children.append(0.0)
    start = time.perf_counter()
    try:
        yield
    finally:
        elapsed = time.perf_counter() - start
        nested = timer._children.pop()
        timer.seconds[name] += elapsed - nested
        timer.calls[name] += 1
        if timer._children:
            timer._children[-1] += elapsed

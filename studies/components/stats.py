"""Intervals for the component study: Student-t over captured batches, the jackknife over seeds."""

from __future__ import annotations

import functools
import math
import statistics


@functools.lru_cache(maxsize=None)
def t_quantile(p: float, df: int) -> float:
    """Student-t quantile (p > 0.5) by bisection on its CDF, integrated with Simpson's rule (no
    scipy in this environment). t_quantile(0.975, 11) = 2.2010."""
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def pdf(t: float) -> float:
        return math.exp(log_c - (df + 1) / 2 * math.log1p(t * t / df))

    def cdf(x: float, n: int = 4000) -> float:
        h = x / n
        s = pdf(0.0) + pdf(x) + sum((4 if i % 2 else 2) * pdf(i * h) for i in range(1, n))
        return 0.5 + s * h / 3

    hi = 1.0
    while cdf(hi) < p:
        hi *= 2
    lo = hi / 2 if hi > 1 else 0.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def interval(values) -> dict:
    """Mean and 95 % t-interval of independent values (None bounds for n < 2)."""
    v = [float(x) for x in values if x is not None and math.isfinite(float(x))]
    n = len(v)
    if n == 0:
        return {"mean": None, "lo": None, "hi": None, "n": 0}
    mean = statistics.fmean(v)
    if n < 2:
        return {"mean": mean, "lo": None, "hi": None, "n": 1}
    half = t_quantile(0.975, n - 1) * statistics.stdev(v) / math.sqrt(n)
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "n": n}


def negated(ci: dict) -> dict:
    """The interval of -value."""
    flip = lambda v: None if v is None else -v
    return {**ci, "mean": flip(ci["mean"]), "lo": flip(ci["hi"]), "hi": flip(ci["lo"])}


def jackknife(full: float, leave_one_out: list[float]) -> dict:
    """95 % interval of a statistic from its leave-one-out values (jackknife standard error)."""
    n = len(leave_one_out)
    if n < 2:
        return {"mean": full, "lo": None, "hi": None, "n": max(n, 1)}
    m = statistics.fmean(leave_one_out)
    se = math.sqrt((n - 1) / n * sum((v - m) ** 2 for v in leave_one_out))
    half = t_quantile(0.975, n - 1) * se
    return {"mean": full, "lo": full - half, "hi": full + half, "n": n}


def sig(value):
    """6 significant digits: what results.json keeps of a measurement (the report is computed
    from the same rounded values, so --report-only reproduces it exactly)."""
    return float(f"{value:.6g}") if isinstance(value, float) and math.isfinite(value) else value


def excludes_zero(ci: dict) -> bool:
    return ci["lo"] is not None and (ci["lo"] > 0 or ci["hi"] < 0)

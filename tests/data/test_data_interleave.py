"""The interleave bound, closed-form counts and exact phase boundaries (no megatron, fast)."""

from fractions import Fraction
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from data.interleave import Interleave, rational_weights
from data.schedule import PhaseSchedule, Source


def _check_bound(weights, n_max):
    il = Interleave(weights)
    w = il.weights
    q = il.period
    counts = np.zeros(il.k, dtype=np.int64)
    for n in range(1, n_max + 1):
        counts[il.source_at(n - 1)] += 1
        for s in range(il.k):
            exact = w[s] * n
            assert math.floor(exact) <= counts[s] <= math.ceil(exact), (weights, n, s, counts)
        if n % 13 == 0 or n == n_max:
            assert (il.counts(n) == counts).all()
            assert all(il.count(n, s) == counts[s] for s in range(il.k))
    return il


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=8))
def test_bound_every_prefix_integer_weights(ms):
    il = _check_bound(ms, 2 * sum(ms) + 7)
    assert il.exact and il.period == sum(ms) // math.gcd(*ms)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.sampled_from([0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.45, 0.6, 1.0, 2.5]), min_size=2, max_size=7))
def test_bound_decimal_weights(ws):
    il = _check_bound(ws, 400)
    total = sum(Fraction(repr(w)) for w in ws)
    assert il.exact and il.weights == [Fraction(repr(w)) / total for w in ws]


def test_greedy_counterexample_is_within_bound():
    # "largest deficit first" drifts to 1.07 here; EDF must not
    _check_bound([38, 1, 38, 3, 9], 89 * 2)


def test_inexact_weights_are_rounded_and_periodic():
    il = Interleave([1 / 7, 2 / 7, 4 / 7 + 1e-9])
    assert not il.exact and il.period == 1 << 16 and sum(il.m) == il.period
    assert all(abs(float(a) - b) < 2 / il.period for a, b in zip(il.weights, [1 / 7, 2 / 7, 4 / 7]))
    # counts far away by arithmetic == period multiples + partial
    n = 10**9 + 12345
    c = il.counts(n)
    assert c.sum() == n
    assert np.all(np.abs(c - np.array([float(x) for x in il.weights]) * n) < 1)


def test_rational_weights():
    assert rational_weights([0.45, 0.3, 0.25]) == ([9, 6, 5], 20, True)
    assert rational_weights([1, 1, 1]) == ([1, 1, 1], 3, True)
    with pytest.raises(ValueError):
        rational_weights([1, 0])


def _sources(k):
    return [Source(key=f"c{j}/0", category=f"c{j}", prefix="", weight_in_category=Fraction(1),
                   num_documents=1, num_tokens=10**6, samples_per_epoch=1000) for j in range(k)]


def test_phase_switches_at_exact_sample():
    seq, total = 16, 16 * 1000 + 5
    phases = [("a", 0.5, {"c0": 1, "c1": 1}), ("b", 0.8, {"c1": 1}), ("c", 1.0, {"c0": 3, "c1": 1})]
    sch = PhaseSchedule(_sources(2), phases, total, seq)
    # phase a ends at token floor(0.5 * 16005) = 8002: sample 500 starts at 8000 (< 8002), 501 at 8016
    assert [p.start for p in sch.phases] == [0, 501, 801]
    assert sch.phase_of(500) == 0 and sch.phase_of(501) == 1
    # phase b ends at floor(0.8 * 16005) = 12804 -> ceil(12804 / 16) = 801 (800 starts at 12800)
    assert sch.phase_of(800) == 1 and sch.phase_of(801) == 2
    assert sch.phase_of(10**12) == 2  # past the end: stays in the last phase
    # in phase b only c1
    assert all(sch.locate(i)[1] == 1 for i in range(501, 801))
    # counts: running == closed form, across phases
    counts = np.zeros(2, dtype=np.int64)
    for i in range(1100):
        p, s, k = sch.locate(i)
        assert k == counts[s]
        counts[s] += 1
        assert (sch.counts_at(i + 1) == counts).all()


def test_locate_far_index_is_fast():
    import time

    sch = PhaseSchedule(_sources(8), [("a", 0.7, {f"c{j}": j + 1 for j in range(8)}),
                                      ("b", 1.0, {"c0": 0.3, "c7": 0.7})], 10**13, 8192)
    t = time.perf_counter()
    for _ in range(100):
        sch.locate(10**9)
    assert (time.perf_counter() - t) / 100 < 0.005

"""Deterministic weighted interleave with O(1) random access.

Given source weights w_s (sum 1) we want a sequence of source ids such that, at every prefix of
length n, each source's count c_s(n) satisfies  floor(w_s n) <= c_s(n) <= ceil(w_s n)  (so
|c_s(n) - w_s n| < 1), and such that the source of element n and all counts c_s(n) can be
computed by arithmetic, without iterating to n.

How:
1. The weights are made rational: w_s = m_s / Q with integers m_s summing to Q. Q is the exact
   common denominator of the weights as written (0.45/0.3/0.25 -> Q = 20) when that is at most
   ``MAX_PERIOD``; otherwise the weights are rounded to multiples of 1/MAX_PERIOD by largest
   remainders (``Interleave.exact`` is then False; the deviation is < 1/MAX_PERIOD per weight).
2. One period of Q slots is scheduled by earliest-deadline-first over "Pfair" windows: the j-th
   element of source s may go in slot t only if floor(j Q/m_s) <= t < ceil((j+1) Q/m_s). Such a
   schedule exists for total weight 1 (Baruah et al., 1996) and EDF finds it on one "processor";
   meeting every window is exactly the floor/ceil bound above. (The simpler "largest deficit
   first" greedy can drift past 1: e.g. m = [38, 1, 38, 3, 9], Q = 89 reaches 1.07.)
3. After Q slots every count is exactly m_s, so the sequence is periodic:
   source(n) = pattern[n mod Q],  c_s(n) = (n // Q) m_s + c_s(n mod Q),
   the last term from a checkpoint table every ``CHECKPOINT`` slots plus a short count.
Memory: O(Q + k Q / CHECKPOINT), independent of how long the run is.
"""

from __future__ import annotations

import heapq
import math
from fractions import Fraction
from typing import List, Sequence, Tuple, Union

import numpy as np

MAX_PERIOD = 1 << 16
CHECKPOINT = 256

Number = Union[int, float, Fraction]


def to_fraction(x: Number) -> Fraction:
    """Decimal-exact fraction of a config number (0.3 -> 3/10, not the binary float)."""
    if isinstance(x, Fraction):
        return x
    if isinstance(x, int):
        return Fraction(x)
    return Fraction(repr(float(x)))


def rational_weights(weights: Sequence[Number], max_period: int = MAX_PERIOD) -> Tuple[List[int], int, bool]:
    """-> (m, Q, exact): integer shares m_s of a period Q with sum(m) == Q."""
    if not weights:
        raise ValueError("no weights")
    fr = [to_fraction(w) for w in weights]
    if any(f <= 0 for f in fr):
        raise ValueError(f"weights must be positive: {list(weights)}")
    total = sum(fr)
    fr = [f / total for f in fr]
    q = 1
    for f in fr:
        q = q * f.denominator // math.gcd(q, f.denominator)
        if q > max_period:
            break
    if q <= max_period:
        m = [int(f * q) for f in fr]
        return m, q, True
    # largest remainder at Q = max_period
    q = max_period
    raw = [f * q for f in fr]
    m = [int(math.floor(r)) for r in raw]
    short = q - sum(m)
    order = sorted(range(len(fr)), key=lambda s: (-(raw[s] - m[s]), s))
    for s in order[:short]:
        m[s] += 1
    return m, q, False


def edf_pattern(m: Sequence[int], q: int) -> np.ndarray:
    """One period of the schedule (see module doc). Ties go to the lower source index."""
    k = len(m)
    dtype = np.uint8 if k <= 256 else np.uint16 if k <= 65536 else np.uint32
    pattern = np.empty(q, dtype=dtype)
    nxt = [0] * k  # next element index j of each source
    ready: List[Tuple[int, int]] = []  # (deadline, source)
    waiting: List[Tuple[int, int]] = []  # (release, source)
    for s, ms in enumerate(m):
        if ms > 0:
            heapq.heappush(ready, (-((-q) // ms), s))  # deadline of j=0: ceil(Q/m)
    for t in range(q):
        while waiting and waiting[0][0] <= t:
            _, s = heapq.heappop(waiting)
            j = nxt[s]
            heapq.heappush(ready, (-((-(j + 1) * q) // m[s]), s))
        if not ready:
            raise AssertionError(f"EDF idle at slot {t} (m={list(m)}, Q={q})")
        deadline, s = heapq.heappop(ready)
        if deadline <= t:
            raise AssertionError(f"EDF missed a window at slot {t} (m={list(m)}, Q={q})")
        pattern[t] = s
        nxt[s] += 1
        j = nxt[s]
        if j < m[s]:
            release = (j * q) // m[s]
            if release <= t + 1:
                heapq.heappush(ready, (-((-(j + 1) * q) // m[s]), s))
            else:
                heapq.heappush(waiting, (release, s))
    return pattern


class Interleave:
    """Random-access view of the infinite periodic interleave for one set of weights."""

    def __init__(self, weights: Sequence[Number], max_period: int = MAX_PERIOD):
        self.m, self.period, self.exact = rational_weights(weights, max_period)
        self.k = len(self.m)
        self.m_arr = np.asarray(self.m, dtype=np.int64)
        self.pattern = edf_pattern(self.m, self.period)
        # counts before slot c*CHECKPOINT, for c = 0..ceil(Q/CHECKPOINT)
        n_cp = -(-self.period // CHECKPOINT) + 1
        onehot_counts = np.zeros((n_cp, self.k), dtype=np.int64)
        for c in range(1, n_cp):
            seg = self.pattern[(c - 1) * CHECKPOINT : c * CHECKPOINT]
            onehot_counts[c] = onehot_counts[c - 1] + np.bincount(seg, minlength=self.k)
        self.checkpoints = onehot_counts

    @property
    def weights(self) -> List[Fraction]:
        """The realized (rational) weights m_s / Q."""
        return [Fraction(ms, self.period) for ms in self.m]

    def source_at(self, n: int) -> int:
        return int(self.pattern[n % self.period])

    def _partial(self, r: int) -> np.ndarray:
        c, rem = divmod(r, CHECKPOINT)
        base = self.checkpoints[c]
        if rem == 0:
            return base.copy()
        return base + np.bincount(self.pattern[c * CHECKPOINT : r], minlength=self.k)

    def counts(self, n: int) -> np.ndarray:
        """Per-source counts among elements [0, n)."""
        p, r = divmod(n, self.period)
        return p * self.m_arr + self._partial(r)

    def count(self, n: int, s: int) -> int:
        """Count of source s among elements [0, n)."""
        p, r = divmod(n, self.period)
        c, rem = divmod(r, CHECKPOINT)
        extra = int(np.count_nonzero(self.pattern[c * CHECKPOINT : r] == s)) if rem else 0
        return p * self.m[s] + int(self.checkpoints[c, s]) + extra

    def nbytes(self) -> int:
        return int(self.pattern.nbytes + self.checkpoints.nbytes + self.m_arr.nbytes)

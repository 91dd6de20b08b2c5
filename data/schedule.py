"""The phase schedule: which phase, category and source every global sample comes from.

Global sample i covers tokens [i*seq, (i+1)*seq) of the run. Phase p ends at token
T_p = floor(end_fraction_p * total_tokens) (end_fraction read as the decimal it is written as); a
sample belongs to the phase in which its first token lies: phase p holds samples [B_{p-1}, B_p)
with B_p = ceil(T_p / seq). Samples past the last
boundary (a run longer than total_tokens) stay in the last phase.

Inside a phase the source of its n-th sample follows the phase's ``Interleave`` (closed form, see
interleave.py). A source's global count (how many of its samples came before i) is the sum of its
counts in the earlier phases (precomputed once per phase) plus its count inside the current phase.
Locating any sample costs O(log phases + CHECKPOINT), with no iteration over the run.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from fractions import Fraction
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from data.interleave import Interleave, to_fraction


@dataclass
class Source:
    """One indexed dataset taking part in the blend."""

    key: str  # stable id "<category>/<index>" (seeds depend on it, not on the path)
    category: str
    prefix: str  # resolved path prefix
    weight_in_category: Fraction
    num_documents: int
    num_tokens: int
    samples_per_epoch: int = 0  # filled in for a sequence length


@dataclass
class Phase:
    name: str
    end_fraction: float
    category_weights: Dict[str, float]
    start: int = 0  # first global sample
    end: int = 0  # one past the last global sample (the last phase extends past it)
    interleave: Optional[Interleave] = None
    base_counts: Optional[np.ndarray] = None  # per-source counts before this phase
    active: Optional[List[int]] = None  # interleave index -> source index


class PhaseSchedule:
    def __init__(
        self,
        sources: Sequence[Source],
        phases: Sequence[Tuple[str, float, Dict[str, float]]],
        total_tokens: int,
        seq_length: int,
    ):
        if total_tokens <= 0 or seq_length <= 0:
            raise ValueError("total_tokens and seq_length must be positive")
        self.sources = list(sources)
        self.categories = list(dict.fromkeys(s.category for s in self.sources))
        self.total_tokens = int(total_tokens)
        self.seq_length = int(seq_length)
        self.total_samples = -(-self.total_tokens // self.seq_length)
        self.phases: List[Phase] = []
        start = 0
        base = np.zeros(len(self.sources), dtype=np.int64)
        for name, end_fraction, cat_w in phases:
            boundary = int(to_fraction(end_fraction) * self.total_tokens)  # floor
            end = max(start, -(-boundary // self.seq_length))
            weights = self._source_weights(cat_w)
            active = [i for i, w in enumerate(weights) if w > 0]
            il = Interleave([weights[i] for i in active])
            ph = Phase(name, float(end_fraction), dict(cat_w), start, end, il, base.copy(), active)
            self.phases.append(ph)
            base = base + self._phase_counts(ph, end - start)
            start = end
        self._ends = [p.end for p in self.phases]

    def _source_weights(self, cat_w: Dict[str, float]) -> List[Fraction]:
        total = sum(to_fraction(w) for w in cat_w.values())
        out = []
        for s in self.sources:
            w = cat_w.get(s.category)
            out.append(Fraction(0) if w is None else to_fraction(w) / total * s.weight_in_category)
        return out

    def _phase_counts(self, ph: Phase, n: int) -> np.ndarray:
        out = np.zeros(len(self.sources), dtype=np.int64)
        out[ph.active] = ph.interleave.counts(n)
        return out

    # -- random access ------------------------------------------------------------------------
    def phase_of(self, i: int) -> int:
        return min(bisect.bisect_right(self._ends, i), len(self.phases) - 1)

    def locate(self, i: int) -> Tuple[int, int, int]:
        """Global sample i -> (phase, source index, the source's count of samples before i)."""
        p = self.phase_of(i)
        ph = self.phases[p]
        n = i - ph.start
        j = ph.interleave.source_at(n)
        s = ph.active[j]
        return p, s, int(ph.base_counts[s]) + ph.interleave.count(n, j)

    def counts_at(self, i: int) -> np.ndarray:
        """Per-source sample counts among global samples [0, i)."""
        p = self.phase_of(i)
        ph = self.phases[p]
        return ph.base_counts + self._phase_counts(ph, i - ph.start)

    def realized_weights(self, p: int) -> List[Fraction]:
        ph = self.phases[p]
        out = [Fraction(0)] * len(self.sources)
        for j, s in enumerate(ph.active):
            out[s] = ph.interleave.weights[j]
        return out

    def nbytes(self) -> int:
        return sum(p.interleave.nbytes() + p.base_counts.nbytes for p in self.phases)

    # -- display ------------------------------------------------------------------------------
    def describe(self, title: str = "data schedule"):
        """A rich Table: rows = categories, one column per phase (weight %), plus tokens per epoch
        and the epochs each category will have been read by the end of the run."""
        from rich.table import Table

        table = Table(title=title, show_lines=False)
        table.add_column("category")
        for p, ph in enumerate(self.phases):
            lo = 0.0 if p == 0 else self.phases[p - 1].end_fraction
            table.add_column(f"{ph.name}\n{lo:.0%}-{ph.end_fraction:.0%}", justify="right")
        table.add_column("tokens\n/epoch", justify="right")
        table.add_column("epochs\nby end", justify="right")
        final = self.counts_at(self.total_samples)
        for cat in self.categories:
            idx = [i for i, s in enumerate(self.sources) if s.category == cat]
            cells = []
            for p in range(len(self.phases)):
                w = sum(self.realized_weights(p)[i] for i in idx)
                cells.append(f"{float(w):.1%}" if w else "-")
            tok = sum(self.sources[i].num_tokens for i in idx)
            spe = sum(self.sources[i].samples_per_epoch for i in idx)
            epochs = float(final[idx].sum()) / spe if spe else float("nan")
            table.add_row(cat, *cells, _human(tok), f"{epochs:.2f}")
        table.add_section()
        table.add_row("samples", *[f"{_human(ph.start)}-{_human(ph.end)}" for ph in self.phases], "", "",
                      style="dim")
        table.add_row("tokens", *[_human((ph.end - ph.start) * self.seq_length) for ph in self.phases], "", "",
                      style="dim")
        if any(not ph.interleave.exact for ph in self.phases):
            table.caption = "weights rounded to multiples of 1/65536 (shown as realized)"
        return table


def _human(n: float) -> str:
    for unit in ("", "K", "M", "B", "T"):
        if abs(n) < 1000:
            return f"{n:.3g}{unit}"
        n /= 1000
    return f"{n:.3g}P"

"""When a periodic action is due: each component of the loop holds its own `Every`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Every:
    """Due after every `n`-th step (n <= 0: never) and, when `last` is set, after step `last`."""

    n: int
    last: Optional[int] = None

    def __call__(self, step: int) -> bool:
        return (self.n > 0 and step % self.n == 0) or step == self.last

"""Ranges of numeric config fields, declared on the field where its schema defines it.

    max_steps: int = field(default=200, metadata=at_least(1))
    keep_last: int = field(default=3, metadata=at_least(0, "0 keeps every checkpoint"))
    mfu: float = field(default=0.4, metadata=within(0, 1, low_open=True))

A schema's `__post_init__` (which `OmegaConf.to_object` runs) calls `check_fields(self, "trainer")`:
every field outside its range is refused with `errors.ConfigError` naming the key
(`trainer.max_steps=0 must be >= 1`), and so is a choice field (an Enum) set in Python to none of
its values. A new field is checked by declaring its range; no list of
key names is kept anywhere. A field whose default is None (Optional) may also be None. Booleans,
NaN and infinities are outside every range.

`nvfp4_recipe` ships alone in its wheel and cannot import this module: its schema checks its
few numeric fields by hand (nvfp4_recipe/policy.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from dataclasses import dataclass
from enum import Enum
from typing import Optional

from errors import ConfigError

RANGE = "range"  # the key of a field's metadata that holds its Range


def is_number(value) -> bool:
    """A finite int or float (a bool is not a number here, though Python says it is an int)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Range:
    low: float
    high: Optional[float] = None
    low_open: bool = False  # the low end itself is outside
    high_open: bool = False
    note: str = ""  # what an edge value means, e.g. "0: off"

    def contains(self, value) -> bool:
        if not is_number(value):
            return False
        if value < self.low or (self.low_open and value == self.low):
            return False
        if self.high is not None and (value > self.high or (self.high_open and value == self.high)):
            return False
        return True

    def rule(self, nullable: bool = False) -> str:
        if self.high is None:
            text = f"must be a finite number > {self.low}" if self.low_open else f"must be >= {self.low}"
        else:
            text = (f"must be in {'(' if self.low_open else '['}{self.low}, {self.high}"
                    f"{')' if self.high_open else ']'}")
        note = self.note or ("or null" if nullable else "")
        return f"{text} ({note})" if note else text


def at_least(low: float, note: str = "") -> dict:
    """Field metadata: value >= low."""
    return {RANGE: Range(low, note=note)}


def above(low: float, note: str = "") -> dict:
    """Field metadata: value > low (a finite number)."""
    return {RANGE: Range(low, low_open=True, note=note)}


def within(low: float, high: float, *, low_open: bool = False, high_open: bool = False,
           note: str = "") -> dict:
    """Field metadata: value in [low, high], either end open on request."""
    return {RANGE: Range(low, high, low_open=low_open, high_open=high_open, note=note)}


def check_fields(obj, prefix: str, error: type[ConfigError] = ConfigError) -> None:
    """Refuse the first field of dataclass `obj` outside its declared range (`error`, a
    ConfigError, `<prefix>.<field>=<value> <rule>`) or, for a choice (an Enum-typed field), none
    of its values: Hydra refuses such a value while composing, this refuses one set in Python."""
    choices = _choice_fields(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        nullable = f.default is None
        if value is None and nullable:
            continue
        bounds = f.metadata.get(RANGE)
        if bounds is not None and not bounds.contains(value):
            raise error(f"{prefix}.{f.name}={value} {bounds.rule(nullable)}")
        if f.name in choices and value not in [member.value for member in choices[f.name]]:
            raise error(f"{prefix}.{f.name}={value!r}: choose one of "
                              f"{', '.join(member.value for member in choices[f.name])}")


@functools.cache
def _choice_fields(cls) -> dict[str, type[Enum]]:
    """{field name: its Enum type} of dataclass `cls` (an Optional choice included)."""
    hints = typing.get_type_hints(cls)
    found = {}
    for f in dataclasses.fields(cls):
        for candidate in (hints[f.name], *typing.get_args(hints[f.name])):
            if isinstance(candidate, type) and issubclass(candidate, Enum):
                found[f.name] = candidate
    return found

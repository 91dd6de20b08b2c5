"""field_ranges: a range declared on a dataclass field, checked by the schema's __post_init__."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Optional

import pytest

from errors import ConfigError, ExitCode
from field_ranges import above, at_least, check_fields, within


class Colour(StrEnum):
    red = "red"
    blue = "blue"


@dataclass
class Schema:
    every: int = field(default=1, metadata=at_least(1))
    off_or_more: int = field(default=0, metadata=at_least(0, "0: off"))
    rate: float = field(default=0.5, metadata=above(0))
    share: float = field(default=1.0, metadata=within(0, 1, low_open=True))
    beta: float = field(default=0.0, metadata=within(0, 1, high_open=True))
    limit: Optional[int] = field(default=None, metadata=at_least(1))
    colour: Colour = Colour.red
    free: int = -7  # no range declared: anything goes

    def __post_init__(self):
        check_fields(self, "group")


@pytest.mark.parametrize("key,value,message", [
    ("every", 0, "group.every=0 must be >= 1"),
    ("off_or_more", -1, "group.off_or_more=-1 must be >= 0 (0: off)"),
    ("rate", 0.0, "group.rate=0.0 must be a finite number > 0"),
    ("rate", math.inf, "group.rate=inf must be a finite number > 0"),
    ("rate", math.nan, "group.rate=nan must be a finite number > 0"),
    ("share", 0.0, "group.share=0.0 must be in (0, 1]"),
    ("share", 1.5, "group.share=1.5 must be in (0, 1]"),
    ("beta", 1.0, "group.beta=1.0 must be in [0, 1)"),
    ("every", True, "group.every=True must be >= 1"),  # a bool is not a count
    ("limit", 0, "group.limit=0 must be >= 1 (or null)"),
    ("colour", "green", "group.colour='green': choose one of red, blue"),
])
def test_a_value_outside_its_field_is_refused_naming_the_key(key, value, message):
    with pytest.raises(ConfigError) as err:
        Schema(**{key: value})
    assert str(err.value) == message and err.value.code == ExitCode.CONFIG


@pytest.mark.parametrize("key,value", [
    ("every", 1), ("off_or_more", 0), ("rate", 1e-30), ("share", 1.0), ("beta", 0.0),
    ("limit", None), ("limit", 1), ("colour", "blue"), ("free", -10**9),
])
def test_the_edges_null_and_undeclared_fields_are_accepted(key, value):
    assert getattr(Schema(**{key: value}), key) == value


def test_a_caller_chooses_its_config_error_subclass():
    class GroupError(ConfigError):
        pass

    with pytest.raises(GroupError, match=r"^g\.every=0 must be >= 1$"):
        check_fields(_unchecked(every=0), "g", GroupError)


def _unchecked(**values) -> Schema:
    """A Schema instance whose __post_init__ has not run (fields set afterwards)."""
    schema = Schema()
    for key, value in values.items():
        setattr(schema, key, value)
    return schema

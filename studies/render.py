"""The studies' reports: Markdown templates (studies/templates/*.md.j2) filled with a study's data.

The prose lives in the templates; the code computes the numbers and hands them over, with the
filters below for formatting them. StrictUndefined: a name the data does not carry is an error,
not an empty cell.
"""

from __future__ import annotations

from pathlib import Path

import jinja2

TEMPLATES = Path(__file__).resolve().parent / "templates"


def fmt(value, spec: str = ".4f", none: str = "—") -> str:
    """`value` formatted by `spec`, or `none` for a missing value."""
    return none if value is None else format(value, spec)


def environment(**filters) -> jinja2.Environment:
    """The templates' environment: block tags take their line with them (trim_blocks,
    lstrip_blocks), so a template reads as the Markdown it writes."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                             autoescape=False)
    env.filters.update(fmt=fmt, **filters)
    return env


def render(template: str, filters: dict | None = None, **data) -> str:
    return environment(**(filters or {})).get_template(template).render(**data)

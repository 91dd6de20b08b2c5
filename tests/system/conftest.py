"""The system tier: tests that start processes (train.py, torchrun, a module's command line,
ranks spawned over gloo) or train runs of several steps. Each test collected here is marked
`slow`, so `-m "not slow"` and `--ignore=tests/system` select the same unit tier
(tests/test_suite_tiers.py keeps the marker out of the other directories)."""

from __future__ import annotations

from pathlib import Path

import pytest

SYSTEM = Path(__file__).resolve().parent


def in_system_tier(path: Path) -> bool:
    return SYSTEM in Path(path).resolve().parents


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    """Mark this tier's tests slow and run them after the unit tier's (in their own order), so
    that a session of both (`make test`) reports a broken unit test within minutes. The hook sees
    the whole session's items, not only this directory's."""
    system = [item for item in items if in_system_tier(item.path)]
    for item in system:
        item.add_marker(pytest.mark.slow)
    items[:] = [item for item in items if not in_system_tier(item.path)] + system

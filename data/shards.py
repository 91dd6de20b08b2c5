"""Sharded datasets: names, globs and completeness checks (light: no megatron, no tokenizer).

``python -m data.prepare --shard I/N --output PREFIX`` writes ``PREFIX_shardI``; a shard is
complete when its ``.bin``, ``.idx`` and sidecar ``.json`` exist (the sidecar is renamed into place
before the ``.idx``, so a ``.idx`` means the rest is there). The sidecar's ``shard`` entry records
``{"index": I, "count": N, "prefix": PREFIX}``, which lets a reader find a missing shard.

Used by ``data.config`` (a schedule's ``prefixes`` may be a glob such as ``/data/web/web_shard*``)
and by ``python -m data.prepare --check PREFIX``.
"""

from __future__ import annotations

import glob
import json
import os
import re
from typing import Dict, List, Optional, Tuple

SHARD_INFIX = "_shard"
EXTS = (".bin", ".idx", ".json")
_SHARD_NAME = re.compile(r"_shard(\d+)$")
_GLOB_CHARS = "*?["


def shard_prefix(prefix: str, index: int) -> str:
    return f"{prefix}{SHARD_INFIX}{index}"


def is_glob(prefix: str) -> bool:
    return any(ch in prefix for ch in _GLOB_CHARS)


def natural_key(s: str) -> List:
    """web_shard2 before web_shard10: digit runs compare as numbers."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def read_json(path: str) -> Optional[Dict]:
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def glob_prefixes(pattern: str) -> List[str]:
    """Dataset prefixes matching ``pattern`` (any of .bin/.idx/.json present), natural order.
    Temporaries of a writer (``*.tmp-*``) are never matches."""
    pattern = os.path.expanduser(pattern)
    found = set()
    for ext in EXTS:
        for path in glob.glob(pattern + ext):
            prefix = path[: -len(ext)]
            if ".tmp-" not in os.path.basename(prefix):
                found.add(prefix)
    return sorted(found, key=natural_key)


def dataset_problem(prefix: str) -> Optional[str]:
    """Why ``prefix`` is not a complete dataset made by data.prepare, or None."""
    missing = [ext for ext in EXTS if not os.path.isfile(prefix + ext)]
    if missing:
        return f"incomplete: {', '.join(missing)} missing"
    if read_json(prefix + ".json") is None:
        return "its sidecar .json is not valid JSON"
    return None


def find_shards(prefix: str) -> Dict[int, str]:
    """index -> shard prefix, for every ``PREFIX_shard<I>`` with at least one file on disk."""
    out: Dict[int, str] = {}
    for p in glob_prefixes(glob.escape(prefix) + SHARD_INFIX + "*"):
        m = _SHARD_NAME.search(p)
        if m and p[: m.start()] == prefix:
            out[int(m.group(1))] = p
    return out


def shard_info(meta: Optional[Dict]) -> Optional[Tuple[str, int, int]]:
    """(base prefix, index, count) from a sidecar, or None for an unsharded dataset."""
    sh = (meta or {}).get("shard")
    if not isinstance(sh, dict):
        return None
    try:
        return str(sh["prefix"]), int(sh["index"]), int(sh["count"])
    except (KeyError, TypeError, ValueError):
        return None


def missing_shards(prefixes: List[str]) -> List[str]:
    """Shards that the sidecars of ``prefixes`` say exist but are not among them (a task that
    never finished): ``PREFIX_shardI`` for every index in 0..count-1 not present."""
    groups: Dict[Tuple[str, int], set] = {}
    for p in prefixes:
        info = shard_info(read_json(p + ".json"))
        m = _SHARD_NAME.search(p)
        if info is not None and m is not None:  # the base from the path: the data may have moved
            groups.setdefault((p[: m.start()], info[2]), set()).add(int(m.group(1)))
    out = []
    for (base, count), have in groups.items():
        out += [shard_prefix(base, i) for i in range(count) if i not in have]
    return out

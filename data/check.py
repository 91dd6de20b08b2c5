"""``python -m data.prepare --check PREFIX...``: are the shards of each prefix all there, complete
and made the same way? Prints documents and tokens per prefix (a category) and in total.

A shard is complete when its .bin, .idx and sidecar exist and agree: the .idx header (megatron's
``MMIDIDX`` format) counts the sidecar's documents, and the .bin holds exactly its tokens. Every
shard of every prefix must carry the same tokenizer hash (one training run reads them all); the
shards of one prefix must come from the same split (shard count, input files).

Exit codes: 0 all good; 2 shards disagree (tokenizer, split, inputs); 3 a shard is missing or
incomplete. Each problem is one ``error:`` line naming the shard.
"""

from __future__ import annotations

import os
import struct
import sys
from typing import Dict, List, Optional, Tuple

import numpy as np

from data.shards import dataset_problem, find_shards, read_json, shard_info, shard_prefix

_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_HEADER = struct.Struct("<QBQQ")  # version, dtype code, sequences, documents + 1


def index_problem(prefix: str, meta: Dict) -> Optional[str]:
    """Why the .bin/.idx pair disagrees with the sidecar (truncated, swapped), or None."""
    try:
        with open(prefix + ".idx", "rb") as f:
            head = f.read(len(_IDX_MAGIC) + _IDX_HEADER.size)
    except OSError as e:
        return f"cannot read its .idx ({e})"
    if not head.startswith(_IDX_MAGIC) or len(head) < len(_IDX_MAGIC) + _IDX_HEADER.size:
        return "its .idx is not a megatron index"
    _, _, sequences, doc_entries = _IDX_HEADER.unpack(head[len(_IDX_MAGIC):])
    docs, tokens = int(meta.get("documents", -1)), int(meta.get("tokens", -1))
    if sequences != docs or doc_entries != docs + 1:
        return f"its .idx holds {sequences} documents, its sidecar says {docs}"
    idx_size = len(head) + sequences * (4 + 8) + doc_entries * 8
    if os.path.getsize(prefix + ".idx") != idx_size:
        return f"its .idx is {os.path.getsize(prefix + '.idx')} bytes, expected {idx_size}"
    itemsize = np.dtype(meta.get("dtype", "int32")).itemsize
    if os.path.getsize(prefix + ".bin") != tokens * itemsize:
        return (f"its .bin is {os.path.getsize(prefix + '.bin')} bytes, expected {tokens} tokens x "
                f"{itemsize} = {tokens * itemsize}")
    return None


class _Checker:
    def __init__(self):
        self.missing: List[str] = []
        self.inconsistent: List[str] = []
        self.tokenizer: Optional[Tuple[str, str, str]] = None  # (sha, tokenizer path, first shard)
        self.rows: List[Tuple[str, str, int, int, int]] = []

    def check_tokenizer(self, shard: str, meta: Dict) -> None:
        sha = meta.get("tokenizer_sha256")
        if self.tokenizer is None:
            self.tokenizer = (sha, meta.get("tokenizer", "?"), shard)
        elif sha != self.tokenizer[0]:
            self.inconsistent.append(
                f"{shard}: made with tokenizer {meta.get('tokenizer', '?')} (sha256 {str(sha)[:12]}), "
                f"not {self.tokenizer[1]} (sha256 {str(self.tokenizer[0])[:12]}) like {self.tokenizer[2]}")

    def check_prefix(self, given: str) -> None:
        base = os.path.abspath(os.path.expanduser(given))
        name = os.path.basename(base)
        shards = find_shards(base)
        if not shards:
            if any(os.path.exists(base + e) for e in (".bin", ".idx", ".json")):
                self._check_unsharded(base, name)
            else:
                self.missing.append(f"{base}: no shards ({base}_shard<I>) and no dataset there")
            return
        metas = {i: read_json(p + ".json") for i, p in shards.items()}
        counts = {i: shard_info(m)[2] for i, m in metas.items() if shard_info(m) is not None}
        if len(set(counts.values())) > 1:
            by = ", ".join(f"{shards[i]} says {n}" for i, n in sorted(counts.items()))
            self.inconsistent.append(f"{base}: its shards come from different splits ({by}): remove the old ones")
            return
        n = next(iter(counts.values())) if counts else max(shards) + 1
        docs = tokens = complete = 0
        first_inputs: Optional[Tuple[str, Dict]] = None
        for i in range(n):
            if i not in shards:
                self.missing.append(f"{shard_prefix(base, i)}: missing (shard {i}/{n} never completed: "
                                    f"run it again, e.g. sbatch --array={i} launch/prepare.sbatch ...)")
                continue
            p, meta = shards[i], metas[i]
            problem = dataset_problem(p) or index_problem(p, meta)
            if problem is not None:
                self.missing.append(f"{p}: {problem}")
                continue
            info = shard_info(meta)
            if info is None or info[1] != i:
                self.inconsistent.append(f"{p}: its sidecar says it is shard {info and info[1]}, not {i}")
                continue
            inputs = meta.get("input_set")
            if first_inputs is None:
                first_inputs = (p, inputs)
            elif inputs != first_inputs[1]:
                self.inconsistent.append(f"{p}: made from other input files than {first_inputs[0]} "
                                         f"(the inputs changed between tasks): rebuild with --overwrite")
                continue
            self.check_tokenizer(p, meta)
            complete += 1
            docs += int(meta["documents"])
            tokens += int(meta["tokens"])
        for i in sorted(shards):
            if i >= n:
                self.inconsistent.append(f"{shards[i]}: shard index {i} but the split has {n} shards")
        self.rows.append((name, f"{complete}/{n}", docs, tokens, n))

    def _check_unsharded(self, base: str, name: str) -> None:
        problem = dataset_problem(base)
        meta = read_json(base + ".json") or {}
        problem = problem or index_problem(base, meta)
        if problem is not None:
            self.missing.append(f"{base}: {problem}")
            return
        self.check_tokenizer(base, meta)
        self.rows.append((name, "1/1", int(meta["documents"]), int(meta["tokens"]), 1))


def check_prefixes(prefixes: List[str]) -> int:
    from rich.console import Console
    from rich.table import Table

    c = _Checker()
    for p in prefixes:
        c.check_prefix(p)
    for msg in c.inconsistent + c.missing:
        print(f"error: {msg}", file=sys.stderr, flush=True)
    t = Table(title="data.prepare --check")
    for col in ("category", "shards", "documents", "tokens"):
        t.add_column(col, justify="left" if col == "category" else "right")
    for name, shards, docs, tokens, _ in c.rows:
        t.add_row(name, shards, f"{docs:,}", f"{tokens:,}")
    t.add_section()
    t.add_row("total", "", f"{sum(r[2] for r in c.rows):,}", f"{sum(r[3] for r in c.rows):,}")
    Console(width=200).print(t)
    if c.tokenizer is not None:
        print(f"tokenizer: {c.tokenizer[1]} (sha256 {str(c.tokenizer[0])[:12]})")
    if c.inconsistent:
        return 2
    if c.missing:
        return 3
    print("all shards complete and consistent", flush=True)
    return 0

"""``python -m data.prepare --check PREFIX...``: are the shards of each prefix all there, complete,
intact and made the same way? Prints documents and tokens per prefix (a category) and in total.

A shard is complete when its .bin, .idx and sidecar exist and agree: the .idx header (megatron's
``MMIDIDX`` format) counts the sidecar's documents, the .bin holds exactly its tokens, and the
.idx as megatron's own reader sees it (``_IndexReader``) is consistent with the .bin: its lengths
add up to the .bin's tokens, each pointer is the sum of the lengths before it, its token type is
the sidecar's. A shard is intact when the SHA-256 of its .bin and .idx are those its sidecar
recorded when it was written (``checksums``; read with ``--workers`` threads, ~1.7 GB/s each
with SHA-NI); a dataset made before checksums were recorded gets a ``warning:`` line saying its
tokens were not verified. Every shard of every prefix must carry the same tokenizer hash (one
training run reads them all); the shards of one prefix must come from the same split (shard
count, input files).

Exit codes: 0 all good; 2 shards disagree (tokenizer, split, inputs); 3 a shard is missing,
incomplete or corrupt. Each problem is one ``error:`` line naming the shard.
"""

from __future__ import annotations

import os
import struct
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, List, Optional, Tuple

import numpy as np

from errors import ExitCode

from data.indexed import file_sha256, mcore, quiet_megatron_logs
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
    bin_size = os.path.getsize(prefix + ".bin")
    if bin_size != tokens * itemsize:
        return (f"its .bin is {bin_size} bytes, expected {tokens} tokens x "
                f"{itemsize} = {tokens * itemsize}")
    return _lengths_problem(prefix, np.dtype(meta.get("dtype", "int32")), bin_size)


def _lengths_problem(prefix: str, dtype: np.dtype, bin_size: int) -> Optional[str]:
    """The .idx read by megatron's own reader, against the .bin: lengths, pointers, token type."""
    try:
        with quiet_megatron_logs():
            index = mcore().IndexReader(prefix + ".idx", multimodal=False)
    except (AssertionError, ValueError, KeyError, OSError) as e:
        return f"megatron cannot read its .idx ({e})"
    try:
        if np.dtype(index.dtype) != dtype:
            return f"its .idx says {np.dtype(index.dtype).name} tokens, its sidecar {dtype.name}"
        lengths = index.sequence_lengths.astype(np.int64)
        if len(lengths) and lengths.min() < 0:
            return f"its .idx has a negative length (document {int(np.argmin(lengths))})"
        total = int(lengths.sum())
        if total * dtype.itemsize != bin_size:
            return (f"its .idx lengths add up to {total} tokens ({total * dtype.itemsize} bytes), "
                    f"its .bin is {bin_size} bytes")
        expected = np.concatenate([[0], np.cumsum(lengths)[:-1]]) * dtype.itemsize
        wrong = np.flatnonzero(index.sequence_pointers != expected[:len(lengths)])
        if len(wrong):
            return (f"its .idx pointers disagree with its lengths from document {int(wrong[0])} "
                    f"on ({int(index.sequence_pointers[wrong[0]])}, expected "
                    f"{int(expected[wrong[0]])})")
        docs = index.document_indices
        if len(docs) and (docs[0] != 0 or docs[-1] != len(lengths) or np.any(np.diff(docs) < 0)):
            return "its .idx document indices do not run from 0 to its sequence count"
        return None
    finally:
        del index


CHECKSUM = "sha256"


def checksum_problem(prefix: str, meta: Dict, digests: Dict[str, str]) -> Optional[str]:
    """Whether the files' SHA-256 (`digests`: ext -> hex) are those the sidecar recorded."""
    recorded = meta.get("checksums") or {}
    for ext in ("bin", "idx"):
        want = recorded.get(ext)
        if want is not None and digests.get(ext) != want:
            return (f"its .{ext} does not match its {CHECKSUM} in the sidecar (recorded "
                    f"{str(want)[:12]}..., now {str(digests.get(ext))[:12]}...): it changed "
                    "after it was written; rebuild it with --overwrite")
    return None


def _digests(prefix: str) -> Dict[str, str]:
    return {ext: file_sha256(f"{prefix}.{ext}") for ext in ("bin", "idx")}


class _Checker:
    def __init__(self, pool: Optional[ThreadPoolExecutor] = None):
        self.missing: List[str] = []
        self.inconsistent: List[str] = []
        self.unverified: List[str] = []  # datasets whose sidecar records no checksum
        self.tokenizer: Optional[Tuple[str, str, str]] = None  # (sha, tokenizer path, first shard)
        self.rows: List[Tuple[str, str, int, int, int]] = []
        self.pool = pool
        self.hashing: Dict[str, Future] = {}

    def prefetch(self, prefixes: List[str]) -> int:
        """Start hashing every dataset that records checksums (in the pool's threads); returns
        the bytes to read."""
        total = 0
        for given in prefixes:
            base = os.path.abspath(os.path.expanduser(given))
            for p in [base, *find_shards(base).values()]:
                meta = read_json(p + ".json")
                if (meta or {}).get("checksums") and dataset_problem(p) is None:
                    total += os.path.getsize(p + ".bin") + os.path.getsize(p + ".idx")
                    self.hashing[p] = (self.pool.submit(_digests, p) if self.pool is not None
                                       else None)
        return total

    def problem(self, prefix: str, meta: Dict) -> Optional[str]:
        """Why a dataset is missing, incomplete or corrupt, or None."""
        problem = dataset_problem(prefix) or index_problem(prefix, meta)
        if problem is not None:
            return problem
        checksums = meta.get("checksums")
        if not checksums:
            self.unverified.append(prefix)
            return None
        if checksums.get("algorithm") != CHECKSUM:
            return f"its sidecar's checksums use {checksums.get('algorithm')!r}, not {CHECKSUM}"
        future = self.hashing.get(prefix)
        try:
            digests = future.result() if future is not None else _digests(prefix)
        except OSError as e:
            return f"cannot read it to verify its checksums ({e})"
        return checksum_problem(prefix, meta, digests)

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
            problem = self.problem(p, meta or {})
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
        meta = read_json(base + ".json") or {}
        problem = self.problem(base, meta)
        if problem is not None:
            self.missing.append(f"{base}: {problem}")
            return
        self.check_tokenizer(base, meta)
        self.rows.append((name, "1/1", int(meta["documents"]), int(meta["tokens"]), 1))


def check_prefixes(prefixes: List[str], workers: int = 1) -> int:
    from rich.console import Console
    from rich.table import Table

    with ThreadPoolExecutor(max(1, workers)) as pool:
        c = _Checker(pool)
        total = c.prefetch(prefixes)
        if total:
            print(f"verifying the {CHECKSUM} of {len(c.hashing)} dataset(s), "
                  f"{total / 1e9:,.2f} GB, with {max(1, workers)} thread(s)", flush=True)
        for p in prefixes:
            c.check_prefix(p)
    for msg in c.inconsistent + c.missing:
        print(f"error: {msg}", file=sys.stderr, flush=True)
    for p in c.unverified:
        print(f"warning: {p}: no checksum recorded (made before data.prepare recorded them): its "
              ".idx was checked against its .bin, its tokens were not verified; rebuild it with "
              "--overwrite to add one", file=sys.stderr, flush=True)
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
        return ExitCode.CONFIG
    if c.missing:
        return ExitCode.MISSING
    unverified = (f" ({len(c.unverified)} dataset(s) without checksums: their tokens were not "
                  "verified)" if c.unverified else "")
    print(f"all shards complete and consistent{unverified}", flush=True)
    return ExitCode.OK

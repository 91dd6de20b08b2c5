"""Which bytes of which input file this run, or shard ``I/N``, reads.

The inputs, in order, are one byte stream; shard I takes every record that starts in its share of
it (the rule is in the package docstring). A Piece is one file's byte range, with the Parquet row
groups or Arrow record batches inside it; its SHA-256 goes into the sidecar so that a re-run can
tell that a shard's inputs are unchanged.

pyarrow is imported inside tabular_units: it is an optional dependency (the ``hf`` extra).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from data.prepare.inputs import TABULAR, arrow_reader


@dataclass
class Piece:
    """A contiguous byte range [start, end) of one input file that this run reads."""

    file: int
    start: int
    end: int
    whole: bool = False  # read as the whole file (gzip, one document per file, paragraphs)
    units: Optional[List[int]] = None  # Parquet row groups / Arrow record batches
    first_row: int = 0  # Parquet/Arrow: the file's row index of the piece's first row


def _splittable(path: str, kind: str, text_doc: str) -> bool:
    return not path.endswith(".gz") and (kind == "jsonl" or (kind == "text" and text_doc == "line"))


def _line_start_at_or_after(path: str, pos: int, size: int) -> int:
    """The first line start >= pos (the file's size if none)."""
    if pos <= 0:
        return 0
    if pos >= size:
        return size
    with open(path, "rb") as f:
        f.seek(pos - 1)
        return pos - 1 + len(f.readline())  # the line holding byte pos-1 ends just before


def tabular_units(path: str, kind: str) -> Tuple[List[int], List[int]]:
    """(start offset, rows) of each Parquet row group / Arrow record batch of a file."""
    import pyarrow as pa

    if kind == "parquet":
        import pyarrow.parquet as pq

        md = pq.ParquetFile(path).metadata
        starts, rows = [], []
        for i in range(md.num_row_groups):
            rg = md.row_group(i)
            cols = [rg.column(j) for j in range(rg.num_columns)]
            starts.append(min(c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset
                              for c in cols))
            rows.append(rg.num_rows)
        return starts, rows
    with pa.memory_map(path) as mm:
        reader = arrow_reader(mm)
        starts, rows = [], []
        if isinstance(reader, pa.ipc.RecordBatchFileReader):
            # random access without offsets: spread the batches evenly over the file
            n, size = reader.num_record_batches, os.path.getsize(path)
            for i in range(n):
                starts.append(i * size // max(n, 1))
                rows.append(reader.get_batch(i).num_rows)
        else:
            while True:
                pos = mm.tell()
                try:
                    batch = reader.read_next_batch()  # memory-mapped: no copy, no decoding
                except StopIteration:
                    break
                starts.append(pos)
                rows.append(batch.num_rows)
        return starts, rows


def plan_pieces(files: Sequence[str], kinds: Sequence[str], text_doc: str,
                shard: Optional[Tuple[int, int]]) -> List[Piece]:
    """What this run reads: everything, or shard (I, N)'s records (see the package docstring)."""
    sizes = [os.path.getsize(f) for f in files]
    total = sum(sizes)
    pieces: List[Piece] = []
    offset = 0
    for fi, (path, kind, size) in enumerate(zip(files, kinds, sizes)):
        base, offset = offset, offset + size
        if kind in TABULAR:
            starts, rows = tabular_units(path, kind)
            ends = starts[1:] + [size]
            row0 = np.concatenate([[0], np.cumsum(rows)]).astype(int).tolist()
            own = [j for j, s in enumerate(starts) if shard is None or _shard_of(base + s, total, shard[1]) == shard[0]]
            if own:
                pieces.append(Piece(fi, starts[own[0]], ends[own[-1]], units=own, first_row=row0[own[0]]))
        elif shard is None:
            pieces.append(Piece(fi, 0, size, whole=True))
        elif not _splittable(path, kind, text_doc):
            if _shard_of(base, total, shard[1]) == shard[0]:
                pieces.append(Piece(fi, 0, size, whole=True))
        else:
            i, n = shard
            lo, hi = -(-i * total // n) - base, -(-(i + 1) * total // n) - base  # this file's coordinates
            if hi <= 0 or lo >= size:
                continue
            a = _line_start_at_or_after(path, lo, size)
            b = _line_start_at_or_after(path, hi, size)
            if a < b:
                pieces.append(Piece(fi, a, b, whole=(a == 0 and b == size)))
    return pieces


def _shard_of(pos: int, total: int, n: int) -> int:
    return min(pos * n // total, n - 1) if total > 0 else 0


def piece_sha256(path: str, piece: Piece) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(piece.start)
        left = piece.end - piece.start
        while left > 0:
            chunk = f.read(min(left, 8 << 20))
            if not chunk:
                break
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()

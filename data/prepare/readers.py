"""The records of a run's pieces, in input order, still undecoded.

A record is one line of JSON lines or text, one paragraph or file of text, or a slice of a
Parquet/Arrow string column of about ``--batch-bytes``; memory stays bounded by that whatever a
file's size. Decoding and validation happen in the workers (workers.py). A ``.gz`` that ends early
or is corrupt is an InputError naming the file and how far it was read.

pyarrow is imported inside the Parquet/Arrow readers: it is an optional dependency (the ``hf``
extra), and a run over JSON lines or text never loads it.
"""

from __future__ import annotations

import gzip
import os
import zlib
from typing import Iterator, List, Sequence, Tuple

from data.prepare.inputs import arrow_reader
from data.prepare.pieces import Piece
from data.prepare.refusals import NOTHING_WRITTEN, InputError

# (file index, location, payload): location = line number (relative to the piece's first line)
# for text/JSONL, the file's row index of the first value for Parquet/Arrow; payload = the raw
# bytes of one record, or a pyarrow string array of values.
Record = Tuple[int, int, object]


def iter_records(files: Sequence[str], kinds: Sequence[str], pieces: Sequence[Piece], text_doc: str,
                 text_column: str = "text", batch_bytes: int = 1 << 20) -> Iterator[Record]:
    """Records in input order. Bytes stay undecoded: decoding/validation happens in workers."""
    for piece in pieces:
        path, kind = files[piece.file], kinds[piece.file]
        if kind == "parquet":
            yield from _parquet_records(path, piece, text_column, batch_bytes)
        elif kind == "arrow":
            yield from _arrow_records(path, piece, text_column, batch_bytes)
        elif piece.whole:
            yield from _whole_file_records(piece.file, path, kind, text_doc)
        else:
            yield from _line_records(piece.file, path, piece)


def _open(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _whole_file_records(fi: int, path: str, kind: str, text_doc: str) -> Iterator[Record]:
    read = [0, 0]  # uncompressed bytes and lines read whole: where a damaged .gz stops
    with _open(path) as f:
        try:
            if kind == "jsonl" or text_doc == "line":
                for ln, line in enumerate(f, 1):
                    read[0], read[1] = read[0] + len(line), ln
                    if line.strip():
                        yield fi, ln, line
            elif text_doc == "file":
                yield fi, 1, f.read()
            else:  # paragraph
                buf: List[bytes] = []
                start = 1
                for ln, line in enumerate(f, 1):
                    read[0], read[1] = read[0] + len(line), ln
                    if line.strip():
                        if not buf:
                            start = ln
                        buf.append(line)
                    elif buf:
                        yield fi, start, b"".join(buf)
                        buf = []
                if buf:
                    yield fi, start, b"".join(buf)
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:  # only gzip raises these here
            raise InputError(_gzip_problem(path, f, e, *read) + NOTHING_WRITTEN) from None


def _gzip_problem(path: str, f, exc: Exception, done: int, lines: int) -> str:
    """One line: the file, how far its compressed bytes were read, what decompressed whole."""
    try:
        at = f.fileobj.tell()  # the compressed file's read position (the end, when cut short)
    except (AttributeError, OSError, ValueError):
        at = None
    what = "truncated" if isinstance(exc, EOFError) else "corrupt"
    where = f"read to byte {at:,} of {os.path.getsize(path):,}" if at is not None else "unreadable"
    return (f"{path}: {what} gzip ({exc}): {where}, after {done:,} uncompressed bytes "
            f"({lines:,} whole lines); copy it again or leave it out")


def _line_records(fi: int, path: str, piece: Piece) -> Iterator[Record]:
    with open(path, "rb") as f:
        f.seek(piece.start)
        pos = piece.start
        for ln, line in enumerate(f, 1):
            if pos >= piece.end:
                break
            pos += len(line)
            if line.strip():
                yield fi, ln, line


def _compact(arr):
    """A copy holding only ``arr``'s values: pickling a slice would send its whole buffers."""
    import pyarrow as pa

    return pa.concat_arrays([arr])


def _value_slices(arr, max_bytes: int):
    n = len(arr)
    k = max(1, -(-arr.nbytes // max_bytes))
    step = max(1, -(-n // k))
    for s in range(0, n, step):
        yield s, _compact(arr.slice(s, step))


def _parquet_records(path: str, piece: Piece, column: str, batch_bytes: int) -> Iterator[Record]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    md = pf.metadata
    col = pf.schema_arrow.get_field_index(column)
    # rows per read so that one batch is ~batch_bytes of text: memory stays bounded by that
    # (plus one row group's compressed column chunk), whatever the file's size
    size = sum(md.row_group(j).column(col).total_uncompressed_size for j in piece.units)
    rows = sum(md.row_group(j).num_rows for j in piece.units)
    per_batch = max(1, int(batch_bytes * rows / max(size, 1)))
    row = piece.first_row
    for rb in pf.iter_batches(batch_size=per_batch, row_groups=piece.units, columns=[column], use_threads=False):
        arr = rb.column(0)
        for off, part in _value_slices(arr, batch_bytes):
            yield piece.file, row + off, part
        row += len(arr)


def _arrow_records(path: str, piece: Piece, column: str, batch_bytes: int) -> Iterator[Record]:
    import pyarrow as pa

    own = set(piece.units)
    last = max(own)
    with pa.memory_map(path) as mm:  # zero-copy: the page cache holds the data, not the heap
        reader = arrow_reader(mm)
        if isinstance(reader, pa.ipc.RecordBatchFileReader):
            batches = (reader.get_batch(j) for j in range(reader.num_record_batches))
        else:
            batches = iter(reader)
        row = piece.first_row
        for j, batch in enumerate(batches):
            if j > last:
                break
            if j in own:
                arr = batch.column(column)
                for off, part in _value_slices(arr, batch_bytes):
                    yield piece.file, row + off, part
                row += batch.num_rows


def batched(records: Iterator[Record], max_bytes: int) -> Iterator[List[Record]]:
    batch: List[Record] = []
    size = 0
    for rec in records:
        batch.append(rec)
        payload = rec[2]
        size += len(payload) if isinstance(payload, (bytes, bytearray)) else payload.nbytes
        if size >= max_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch

"""Tokenize JSONL, text, Parquet or Hugging Face datasets into megatron-core indexed datasets.

    python -m data.prepare corpus/*.jsonl --tokenizer tok/tokenizer.json --output out/web --workers 4
    python -m data.prepare 'books/**/*.txt' --train-tokenizer 32768 --output out/books
    python -m data.prepare hub/*.parquet --text-column content --tokenizer hf_tok_dir/ --output out/code
    python -m data.prepare corpus/ --tokenizer tok.json --output out/web --shard 3/64   # one of 64 shards
    python -m data.prepare --check out/web out/code          # every shard there, same tokenizer?

Inputs: files, directories or globs (quote globs for ``**``); ``.gz`` is read transparently.
``.jsonl``, ``.ndjson`` and ``.json`` files hold one JSON object per line with the text under
``--json-key`` (default ``text``); ``.parquet`` files and Arrow files (``.arrow``; a directory
written by ``datasets.Dataset.save_to_disk`` stands for its Arrow files, in its ``state.json``
order) hold the text in column ``--text-column`` (default ``text``) and are streamed in record
batches; other files are plain UTF-8 text, one document per file (``--text-doc file``), per line
(``line``) or per blank-line-separated paragraph (``paragraph``). Every document ends with the
tokenizer's end-of-document token (``<|endoftext|>``, or the ``eos_token`` of a Hugging Face
tokenizer directory, which also adds its ``bos_token`` when ``add_bos_token`` is true).

Bad input (malformed JSON, missing/null/non-string field, invalid UTF-8) is skipped, counted and
reported with file:line (file:row N for Parquet/Arrow); ``--strict`` stops at the first one
(exit 7); when every record is dropped, the "no documents" error gives the counts per reason. A
Parquet/Arrow file without the text column, or with a non-string one, is refused before
anything is written. The dataset is written under a temporary name carrying the writer's pid and
host and renamed into place at the end (.bin, then the sidecar, then .idx), so an interrupted run
never leaves a dataset that looks complete; the temporaries of a run that was killed (SIGKILL,
node loss) are removed by the next run on the same output. An existing output is refused unless
``--overwrite``. A sidecar ``PREFIX.json`` records the statistics, the files read (with the
byte ranges and their SHA-256), a digest of every input's path and size, and the tokenizer's hash.

Shards (``--shard I/N``): the inputs, in the order above, are one byte stream of S bytes; shard I
takes every record that starts in bytes [I*S/N, (I+1)*S/N) -- whole lines of JSONL/text, row
groups of Parquet, record batches of Arrow; a ``.gz`` file and a file read as one document or as
paragraphs go whole to the shard in which they start. The shards, in index order, hold exactly
the documents of an unsharded run, in the same order. Shard I is written to ``PREFIX_shardI``;
when that shard is already complete and its sidecar matches (same inputs by size and hash of its
bytes, same tokenizer, same options) it is skipped with exit 0, so a re-submitted array redoes
only what is missing. ``launch/prepare.sbatch`` runs one shard per Slurm array task.

``--train-tokenizer VOCAB`` first trains a byte-level BPE on the input documents and saves it as
``tokenizer.json`` in the output's directory.

One writer per output: ``PREFIX.lock`` (``flock``, opened without following links) is held from
before the output is checked until it is committed; a second run on the same prefix stops at once
naming the first (exit 5). At the commit, an output that another writer put there meanwhile is
never replaced (exit 2) unless ``--overwrite``. The sidecar records the SHA-256 of the ``.bin``
and ``.idx`` (``checksums``), which ``--check`` verifies.

Exit codes (errors.ExitCode): 0 done (or the shard was already complete); 7 bad input under
--strict, no documents, or an input that cannot be read to its end (a truncated or corrupt .gz:
the file and the byte offset named); 8 an output that cannot be written (read-only, not a
directory, disk full); 2 usage errors (bad arguments, no inputs, a Parquet/Arrow file without the text column, a bad
tokenizer, output exists without --overwrite, or appeared while this run was tokenizing); 5
another data.prepare holds the output prefix, or its lock file is a link or not this user's;
130 interrupted (Ctrl-C); 143 terminated (SIGTERM, as Slurm's scancel sends): no output, no
temporaries. Every error is one ``error:`` line. ``--check``: 0 every shard complete and
consistent; 2 shards disagree (tokenizer, inputs, shard count); 3 a shard is missing,
incomplete or corrupt (its .idx lengths disagree with its .bin, or a checksum differs).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import hashlib
import json
import multiprocessing as mp
import os
import sys
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from errors import ConfigError, ExitCode, ProjectError

JSON_EXTS = (".jsonl", ".ndjson", ".json")
PARQUET_EXTS = (".parquet", ".pq")
ARROW_EXTS = (".arrow",)
TABULAR = ("parquet", "arrow")
HF_STATE = "state.json"  # what datasets.Dataset.save_to_disk writes next to its Arrow files
HF_DICT = "dataset_dict.json"  # ... and DatasetDict.save_to_disk above its splits
# (file index, location, payload): location = line number (relative to the piece's first line)
# for text/JSONL, the file's row index of the first value for Parquet/Arrow; payload = the raw
# bytes of one record, or a pyarrow string array of values.
Record = Tuple[int, int, object]



# The refusals of this command are errors.ProjectError's, each with its exit code; main prints
# the message. Those raised once tokenizing began say that no output was written.
NOTHING_WRITTEN = "; no output written"


class StrictError(ProjectError):
    """--strict: a record that cannot be read (exit 7)."""

    code = ExitCode.BAD_INPUT


class InputError(ProjectError):
    """An input that cannot be read to its end (a truncated or corrupt .gz): exit 7."""

    code = ExitCode.BAD_INPUT


class OutputError(ProjectError):
    """The output cannot be written (read-only, not a directory, no permission, disk full): exit 8."""

    code = ExitCode.UNWRITABLE


def _cannot_write(output: str, exc: OSError) -> OutputError:
    where = f": {exc.filename}" if exc.filename else ""
    return OutputError(f"--output {output} cannot be written: {exc.strerror or exc}{where}"
                       f"{NOTHING_WRITTEN}")


class UsageError(ConfigError):
    """Bad arguments or inputs, found before anything is written (exit 2)."""


class Terminated(BaseException):
    """SIGTERM (Slurm's scancel or time limit): unwind so that the temporaries are removed."""


def _on_sigterm(signum, frame):
    raise Terminated()


@dataclass
class Stats:
    documents: int = 0
    tokens: int = 0
    bytes: int = 0
    empty: int = 0
    bad: Counter = field(default_factory=Counter)  # reason -> count
    bad_examples: List[str] = field(default_factory=list)

    @property
    def bad_total(self) -> int:
        return sum(self.bad.values())


# ----------------------------------------------------------------------------------------------
# inputs


def _hf_dataset_files(d: str) -> Optional[List[str]]:
    """The Arrow files of a ``save_to_disk`` directory in their order, or None if ``d`` is not one."""
    if os.path.isfile(os.path.join(d, HF_DICT)):
        splits = sorted(e for e in os.listdir(d) if os.path.isfile(os.path.join(d, e, HF_STATE)))
        raise UsageError(f"{d} is a saved DatasetDict with splits {splits}: give one split's directory "
                         f"(e.g. {os.path.join(d, splits[0] if splits else 'train')})")
    state_path = os.path.join(d, HF_STATE)
    if not os.path.isfile(state_path):
        return None
    try:
        with open(state_path, encoding="utf-8") as f:
            state = json.load(f)
        names = [e["filename"] for e in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"{state_path}: not a datasets save_to_disk state ({e})") from None
    if state.get("_indices_data_files"):
        raise UsageError(f"{d} has an indices mapping: save it with Dataset.flatten_indices() first")
    files = [os.path.join(d, n) for n in names]
    for f in files:
        if not os.path.isfile(f):
            raise UsageError(f"{state_path} lists {f}, which does not exist")
    return files


def expand_inputs(patterns: Sequence[str]) -> List[str]:
    """Files in a stable order: each pattern's matches sorted, directories walked in sorted order
    (a ``save_to_disk`` directory stands for its Arrow files), duplicates dropped."""
    files: List[str] = []
    for pat in patterns:
        if os.path.isdir(pat):
            matches = _walk(pat)
        elif any(ch in pat for ch in "*?["):
            matches = []
            for p in sorted(glob.glob(pat, recursive=True)):
                if os.path.isfile(p):
                    matches.append(p)
                elif os.path.isdir(p) and _hf_dataset_files(p) is not None:
                    matches += _hf_dataset_files(p)
        else:
            matches = [pat] if os.path.isfile(pat) else []
        if not matches:
            raise FileNotFoundError(f"no input file matches {pat!r}")
        files.extend(matches)
    return list(dict.fromkeys(files))


def _walk(d: str) -> List[str]:
    hf = _hf_dataset_files(d)
    if hf is not None:
        return hf
    out = []
    for entry in sorted(os.listdir(d)):
        p = os.path.join(d, entry)
        if os.path.isdir(p):
            out += _walk(p)
        elif os.path.isfile(p):
            out.append(p)
    return out


def file_format(path: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    base = path[:-3] if path.endswith(".gz") else path
    if base.endswith(PARQUET_EXTS):
        return "parquet"
    if base.endswith(ARROW_EXTS):
        return "arrow"
    return "jsonl" if base.endswith(JSON_EXTS) else "text"


def _open(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _arrow_reader(source):
    """An Arrow IPC reader over ``source`` (stream format, as datasets writes, or file format)."""
    import pyarrow as pa

    magic = source.read(6)
    source.seek(0)
    if magic == b"ARROW1":
        return pa.ipc.open_file(source)
    return pa.ipc.open_stream(source)


def check_text_column(path: str, kind: str, column: str) -> None:
    """Refuse (UsageError) a Parquet/Arrow file without a string column ``column``."""
    import pyarrow as pa

    try:
        if kind == "parquet":
            import pyarrow.parquet as pq

            schema = pq.ParquetFile(path).schema_arrow
        else:
            with pa.memory_map(path) as mm:
                schema = _arrow_reader(mm).schema
    except (pa.ArrowException, OSError) as e:
        raise UsageError(f"{path}: cannot read it as {kind} ({e})") from None
    if column not in schema.names:
        raise UsageError(f"{path} has no column {column!r} (columns: {', '.join(schema.names)}): "
                         f"choose one with --text-column")
    t = schema.field(column).type
    if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)):
        raise UsageError(f"{path}: column {column!r} is {t}, not a string column: choose one with --text-column")


# ----------------------------------------------------------------------------------------------
# planning: which bytes of which file this run (or shard) reads


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
        reader = _arrow_reader(mm)
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
    """What this run reads: everything, or shard (I, N)'s records (see the module docstring)."""
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


# ----------------------------------------------------------------------------------------------
# reading


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
        reader = _arrow_reader(mm)
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


def parse_record(raw: bytes, kind: str, json_key: str) -> Tuple[Optional[str], Optional[str]]:
    """-> (text, None) or (None, reason)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"invalid UTF-8 at byte {e.start}"
    if kind != "jsonl":
        return text, None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"malformed JSON ({e.msg})"
    if not isinstance(obj, dict) or json_key not in obj:
        return None, f"missing field {json_key!r}"
    val = obj[json_key]
    if not isinstance(val, str):
        return None, f"field {json_key!r} is {type(val).__name__}, not a string"
    return val, None


def _arrow_texts(arr, column: str) -> List[Tuple[Optional[str], Optional[str]]]:
    """(text, None) or (None, reason) per value of a string array."""
    try:
        vals = arr.to_pylist()
    except UnicodeDecodeError:  # Arrow strings are meant to be UTF-8; a writer may not have checked
        import pyarrow as pa

        vals = arr.cast(pa.large_binary()).to_pylist() if not pa.types.is_string_view(arr.type) \
            else arr.view(pa.binary_view()).to_pylist()
        out = []
        for v in vals:
            if v is None:
                out.append((None, f"field {column!r} is null"))
            else:
                out.append(parse_record(v, "text", column))
        return out
    return [(None, f"field {column!r} is null") if v is None else (v, None) for v in vals]


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


# ----------------------------------------------------------------------------------------------
# worker side (also run in-process with --workers 1)

_W = {}


def _init_worker(tokenizer_init: tuple, kinds: List[str], json_key: str, text_column: str,
                 single_thread: bool) -> None:
    if single_thread:
        os.environ["RAYON_NUM_THREADS"] = "1"
    from data.tokenizer import TokenizerSpec

    _W.update(spec=TokenizerSpec.from_init(tokenizer_init), kinds=kinds, json_key=json_key,
              text_column=text_column)


def encode_batch(batch: List[Record]):
    """-> (token arrays, bad [(file, location, reason)], empty count, bytes)."""
    texts, bad, empty, nbytes = [], [], 0, 0

    def take(fi, loc, text, reason):
        nonlocal empty
        if reason is not None:
            bad.append((fi, loc, reason))
        elif not text.strip():
            empty += 1
        else:
            texts.append(text)

    for fi, loc, payload in batch:
        if isinstance(payload, (bytes, bytearray)):
            nbytes += len(payload)
            take(fi, loc, *parse_record(payload, _W["kinds"][fi], _W["json_key"]))
        else:  # a pyarrow string array: its values' bytes count, as a JSONL line's would
            nbytes += payload.nbytes
            for k, (text, reason) in enumerate(_arrow_texts(payload, _W["text_column"])):
                take(fi, loc + k, text, reason)
    arrays = [np.asarray(ids, dtype=np.int32) for ids in _W["spec"].encode_documents(texts)]
    return arrays, bad, empty, nbytes


def _bounded_imap(pool, fn, items: Iterator, window: int):
    """pool.imap in order, with at most ``window`` items read ahead: memory stays bounded however
    fast the input is read."""
    pending = collections.deque()
    for item in items:
        pending.append(pool.apply_async(fn, (item,)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


# ----------------------------------------------------------------------------------------------
# main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m data.prepare",
        description="Tokenize JSONL, text, Parquet or HF datasets into megatron-core indexed datasets (.bin/.idx).",
    )
    p.add_argument("inputs", nargs="*", help="input files, directories or globs (with --check: dataset prefixes)")
    p.add_argument("--output", "-o", help="output prefix (writes PREFIX.bin, PREFIX.idx, PREFIX.json)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--tokenizer", help="tokenizer.json (must contain <|endoftext|>) or a Hugging Face tokenizer "
                                       "directory (tokenizer.json + tokenizer_config.json: its eos/bos tokens)")
    g.add_argument("--train-tokenizer", type=int, metavar="VOCAB",
                   help="train a byte-level BPE of this vocab size on the input; saved as tokenizer.json next to the output")
    p.add_argument("--json-key", default="text", help="JSON field holding the text (default: text)")
    p.add_argument("--text-column", default="text", help="Parquet/Arrow column holding the text (default: text)")
    p.add_argument("--format", choices=["auto", "jsonl", "text", "parquet", "arrow"], default="auto",
                   help="input format; auto = by extension (.jsonl/.ndjson/.json[.gz] = JSONL, .parquet, "
                        ".arrow, else text)")
    p.add_argument("--text-doc", choices=["file", "line", "paragraph"], default="file",
                   help="plain text: one document per file, line, or blank-line-separated paragraph")
    p.add_argument("--workers", type=int, default=1,
                   help="tokenizer processes; with --check, threads verifying checksums (default 1)")
    p.add_argument("--batch-bytes", type=int, default=1 << 20, help="input bytes per work item (default 1 MiB)")
    p.add_argument("--shard", metavar="I/N", help="write only shard I of N (0 <= I < N) to PREFIX_shardI; "
                                                  "skipped when already complete")
    p.add_argument("--check", action="store_true",
                   help="check the shards of each prefix given as input: all present, complete, same tokenizer; "
                        "print tokens per prefix")
    p.add_argument("--strict", action="store_true", help=f"fail on the first bad record (exit {int(ExitCode.BAD_INPUT)})")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output (and tokenizer.json)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def parse_shard(value: str) -> Tuple[int, int]:
    try:
        i, n = (int(x) for x in value.split("/"))
    except ValueError:
        raise UsageError(f"--shard {value!r}: expected I/N with integers, e.g. 3/64") from None
    if not (n >= 1 and 0 <= i < n):
        raise UsageError(f"--shard {value!r}: need 0 <= I < N")
    return i, n


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.check:
        if not args.inputs:
            _error("--check needs at least one dataset prefix")
            return ExitCode.CONFIG
        from data.check import check_prefixes

        return check_prefixes(args.inputs, workers=args.workers)
    try:
        job = _plan(args)
    except ProjectError as e:
        _error(str(e))
        return e.code
    if job is None:  # a complete shard: nothing to do
        return ExitCode.OK
    import signal
    import threading

    from data.indexed import PrefixLock

    in_main = threading.current_thread() is threading.main_thread()  # signal() works only there
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if in_main else None
    lock = PrefixLock(job.prefix)
    try:
        try:
            lock.acquire()  # the first write: held until the output is committed or abandoned
        except OSError as e:
            raise _cannot_write(args.output, e) from None
        _refuse_if_changed(args, job, "since this run started")
        return _run(args, job)
    except ProjectError as e:  # each refusal carries its exit code
        _error(str(e))
        return e.code
    except KeyboardInterrupt:
        _error("interrupted: no output written")
        return ExitCode.INTERRUPTED
    except Terminated:
        _error("terminated (SIGTERM): no output written")
        return ExitCode.TERMINATED
    finally:
        lock.release()
        if in_main:
            signal.signal(signal.SIGTERM, previous)


def _output_state(prefix: str) -> tuple:
    """What is at the output now: (ext, inode, size, mtime) of each of its files."""
    found = []
    for ext in (".bin", ".idx", ".json"):
        try:
            st = os.stat(prefix + ext)
        except (FileNotFoundError, NotADirectoryError):
            continue
        found.append((ext, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(found)


def _refuse_if_changed(args, job: "Job", when: str) -> None:
    """Without --overwrite, the output must still be what _plan accepted (usually nothing): a
    dataset that another writer put there meanwhile is never replaced."""
    if not args.overwrite and _output_state(job.prefix) != job.found:
        raise UsageError(f"refusing to overwrite {job.prefix}: a dataset appeared there {when} "
                         "(another writer); nothing was replaced (pass --overwrite to replace it)")


@dataclass
class Job:
    files: List[str]
    kinds: List[str]
    pieces: List[Piece]
    prefix: str  # where this run writes (PREFIX or PREFIX_shardI)
    shard: Optional[Tuple[int, int]]
    base_prefix: str
    spec: object = None  # TokenizerSpec, None with --train-tokenizer
    expected: Dict = field(default_factory=dict)  # what the sidecar records about the work
    replace_incomplete: bool = False  # a shard's .bin without .idx is there: replace it
    found: tuple = ()  # _output_state when planned: what may be replaced without --overwrite


def _plan(args) -> Optional[Job]:
    """Everything that can be refused, refused before anything is written (UsageError)."""
    if not args.inputs:
        raise UsageError("no inputs given")
    if not args.output:
        raise UsageError("--output PREFIX is required")
    if args.tokenizer is None and args.train_tokenizer is None:
        raise UsageError("one of --tokenizer or --train-tokenizer is required")
    if args.workers < 1:
        raise UsageError(f"--workers {args.workers}: must be >= 1")
    if args.batch_bytes < 1:
        raise UsageError(f"--batch-bytes {args.batch_bytes}: must be >= 1")
    shard = parse_shard(args.shard) if args.shard else None
    if shard and args.train_tokenizer:
        raise UsageError("--shard with --train-tokenizer would train one tokenizer per shard: "
                         "train it first, then pass --tokenizer")
    base = os.path.abspath(os.path.expanduser(args.output))
    prefix = base if shard is None else None
    if shard is not None:
        from data.shards import shard_prefix

        prefix = shard_prefix(base, shard[0])
    try:
        files = expand_inputs(args.inputs)
    except FileNotFoundError as e:
        raise UsageError(str(e)) from None
    kinds = [file_format(f, args.format) for f in files]
    for f, k in zip(files, kinds):
        if k in TABULAR:
            if f.endswith(".gz"):
                raise UsageError(f"{f}: compressed {k} is read through its own compression, not .gz")
            check_text_column(f, k, args.text_column)
    spec = None
    if args.tokenizer is not None:
        from data.tokenizer import load_tokenizer_spec

        try:
            spec = load_tokenizer_spec(args.tokenizer)
        except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception
            raise UsageError(f"cannot load tokenizer {args.tokenizer!r}: {e}") from None
    pieces = plan_pieces(files, kinds, args.text_doc, shard)
    job = Job(files, kinds, pieces, prefix, shard, base, spec)
    job.expected = _work_record(args, job)
    job.found = _output_state(prefix)
    existing = [prefix + e for e in (".bin", ".idx") if os.path.exists(prefix + e)]
    if shard is not None:
        _check_siblings(args, base, shard)
        if existing and not args.overwrite:
            if not os.path.exists(prefix + ".idx"):
                # .bin without .idx: a crash between the renames left nothing usable; redo it
                job.replace_incomplete = True
                return job
            if _is_same_complete_shard(job):
                return None
    if not args.overwrite:
        if args.train_tokenizer and os.path.exists(_tokenizer_out(prefix)):
            existing.append(_tokenizer_out(prefix))
        if existing:
            raise UsageError(f"refusing to overwrite {', '.join(existing)} (pass --overwrite)")
    return job


def _work_record(args, job: Job) -> Dict:
    """The sidecar fields that say what was tokenized and how (compared to skip a complete shard)."""
    tabular = any(k in TABULAR for k in job.kinds)
    sizes = [os.path.getsize(f) for f in job.files]
    listing = "".join(f"{f}\t{n}\t{k}\n" for f, n, k in zip(job.files, sizes, job.kinds))
    return {
        "shard": None if job.shard is None else {"index": job.shard[0], "count": job.shard[1],
                                                 "prefix": job.base_prefix},
        # every input (they define the split), as a digest: a shard's sidecar stays small
        # whatever the number of files; the files it read are in "pieces"
        "input_set": {"files": len(job.files), "bytes": sum(sizes),
                      "sha256": hashlib.sha256(listing.encode("utf-8")).hexdigest()},
        "options": {"json_key": args.json_key, "text_column": args.text_column if tabular else None,
                    "text_doc": args.text_doc},
        "tokenizer_sha256": job.spec.sha256 if job.spec is not None else None,
    }


def _check_siblings(args, base: str, shard: Tuple[int, int]) -> None:
    """Shards of another split (another N) next to this one would mix two splits of the inputs."""
    from data.shards import find_shards, read_json, shard_info

    if args.overwrite:
        return
    for i, p in sorted(find_shards(base).items()):
        info = shard_info(read_json(p + ".json"))
        if info is not None and info[2] != shard[1]:
            raise UsageError(f"{p} is shard {info[1]}/{info[2]}, but this run splits into {shard[1]}: "
                             f"remove the old shards of {base} or pass --overwrite")


def _is_same_complete_shard(job: Job) -> bool:
    """True when the shard on disk is complete and was made from the same work; a shard that
    differs is refused (UsageError naming the difference)."""
    from data.check import index_problem
    from data.shards import dataset_problem, read_json

    problem = dataset_problem(job.prefix) or index_problem(job.prefix, read_json(job.prefix + ".json"))
    if problem is not None:
        raise UsageError(f"refusing to overwrite {job.prefix}: {problem} (pass --overwrite)")
    meta = read_json(job.prefix + ".json")
    diff = _difference(meta, job)
    if diff is not None:
        raise UsageError(f"refusing to overwrite {job.prefix}: it was made {diff}; pass --overwrite to rebuild it")
    print(f"{job.prefix}: shard {job.shard[0]}/{job.shard[1]} is complete ({meta.get('documents', 0):,} documents, "
          f"{meta.get('tokens', 0):,} tokens, inputs unchanged): skipped", flush=True)
    return True


def _difference(meta: Dict, job: Job) -> Optional[str]:
    exp = job.expected
    if meta.get("shard") != exp["shard"]:
        return f"as shard {meta.get('shard')}, not {exp['shard']}"
    if meta.get("tokenizer_sha256") != exp["tokenizer_sha256"]:
        return f"with another tokenizer ({meta.get('tokenizer', '?')})"
    if meta.get("options") != exp["options"]:
        return f"with other options ({meta.get('options')} vs {exp['options']})"
    old, new = meta.get("input_set") or {}, exp["input_set"]
    if old != new:
        resized = [f"{p['path']} ({p['size']} -> {os.path.getsize(p['path'])} bytes)" for p in meta.get("pieces", [])
                   if os.path.isfile(p["path"]) and os.path.getsize(p["path"]) != p["size"]]
        return (f"from other inputs ({old.get('files')} files, {old.get('bytes')} bytes; now {new['files']} "
                f"files, {new['bytes']} bytes)" + (": " + ", ".join(resized[:3]) if resized else ""))
    pieces = _piece_records(job)
    if meta.get("pieces") != pieces:
        bad = [p["path"] for p in pieces if p not in meta.get("pieces", [])]
        return "from inputs whose content changed: " + ", ".join(bad[:3] or ["(pieces differ)"])
    return None


def _piece_records(job: Job) -> List[Dict]:
    """What this run reads: per file, the byte range and its SHA-256."""
    return [{"path": job.files[p.file], "size": os.path.getsize(job.files[p.file]), "start": p.start,
             "end": p.end, "sha256": piece_sha256(job.files[p.file], p)} for p in job.pieces]


def _error(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr, flush=True)  # unwrapped: file:line stays greppable


def _tokenizer_out(prefix: str) -> str:
    return os.path.join(os.path.dirname(prefix), "tokenizer.json")


class _Locator:
    """file:line (file:row N for Parquet/Arrow) of a record; a shard that starts mid-file counts
    the lines before it only when it has a bad record to report."""

    def __init__(self, job: Job):
        self.job = job
        self.starts = {p.file: p.start for p in job.pieces}
        self.base: Dict[int, int] = {}

    def __call__(self, fi: int, loc: int) -> str:
        path = self.job.files[fi]
        if self.job.kinds[fi] in TABULAR:
            return f"{path}:row {loc}"
        if fi not in self.base:
            start, n = self.starts.get(fi, 0), 0
            if start:
                with open(path, "rb") as f:
                    left = start
                    while left > 0:
                        chunk = f.read(min(left, 8 << 20))
                        n += chunk.count(b"\n")
                        left -= len(chunk)
            self.base[fi] = n
        return f"{path}:{self.base[fi] + loc}"


def _run(args, job: Job) -> int:
    from rich.console import Console

    from data.indexed import IndexedWriter, mcore
    from data.tokenizer import load_tokenizer_spec, save_tokenizer_atomic, train_bpe_tokenizer

    err, out = Console(stderr=True), Console()
    files, kinds, prefix = job.files, job.kinds, job.prefix
    mcore()  # import megatron-core (~7 s) before the clock starts
    t0 = time.time()
    where = _Locator(job)
    if args.train_tokenizer:
        def texts():
            for batch in batched(iter_records(files, kinds, job.pieces, args.text_doc, args.text_column,
                                              args.batch_bytes), args.batch_bytes):
                for fi, loc, payload in batch:
                    if isinstance(payload, (bytes, bytearray)):
                        results = [(loc, *parse_record(payload, kinds[fi], args.json_key))]
                    else:
                        results = [(loc + k, t, r) for k, (t, r) in enumerate(_arrow_texts(payload, args.text_column))]
                    for at, text, reason in results:
                        if reason is not None and args.strict:
                            raise StrictError(f"{where(fi, at)}: {reason} (--strict)"
                                              f"{NOTHING_WRITTEN}")
                        if text and text.strip():
                            yield text

        with err.status(f"training a {args.train_tokenizer}-token BPE tokenizer on {len(files)} file(s)"):
            tok = train_bpe_tokenizer(texts(), args.train_tokenizer)
        tok_path = _tokenizer_out(prefix)
        if not args.overwrite and os.path.exists(tok_path):  # _plan saw none: it appeared since
            raise UsageError(f"refusing to overwrite {tok_path}: it appeared while this run "
                             "trained its tokenizer (pass --overwrite)")
        try:
            save_tokenizer_atomic(tok, tok_path)
        except OSError as e:
            raise _cannot_write(args.output, e) from None
        err.print(f"tokenizer ({tok.get_vocab_size()} tokens) saved to {tok_path}")
        job.spec = load_tokenizer_spec(tok_path)
        job.expected["tokenizer_sha256"] = job.spec.sha256
    spec = job.spec
    tok = spec.tokenizer

    stats = Stats()
    gz = any(files[p.file].endswith(".gz") for p in job.pieces)
    total_bytes = None if gz else sum(p.end - p.start for p in job.pieces)
    pieces = _piece_records(job)  # the bytes this run reads, hashed: lets a re-run skip a complete shard
    batches = batched(iter_records(files, kinds, job.pieces, args.text_doc, args.text_column, args.batch_bytes),
                      args.batch_bytes)
    init = (spec.to_init(), kinds, args.json_key, args.text_column)
    try:  # what may be replaced was decided in _plan; _refuse_if_changed holds it to that
        writer = IndexedWriter(prefix, tok.get_vocab_size(), overwrite=True)
    except OSError as e:
        raise _cannot_write(args.output, e) from None
    with writer, _progress(not args.no_progress, err) as progress:
        for path in writer.removed_stale:
            err.print(f"removed {path}: a temporary of a data.prepare that was killed",
                      soft_wrap=True, markup=False, highlight=False)
        task = progress.add_task("tokenizing", total=total_bytes, docs=0, tokens=0, tps=0.0)
        if args.workers == 1:
            _init_worker(*init, single_thread=False)
            results = map(encode_batch, batches)
            pool = None
        else:
            pool = mp.get_context("spawn").Pool(args.workers, initializer=_init_worker, initargs=(*init, True))
            results = _bounded_imap(pool, encode_batch, batches, window=2 * args.workers + 2)
        try:
            for arrays, bad, empty, nbytes in results:
                if bad:
                    for fi, loc, reason in bad:
                        if args.strict:
                            raise StrictError(f"{where(fi, loc)}: {reason} (--strict)"
                                              f"{NOTHING_WRITTEN}")
                        stats.bad[reason.split(" (")[0].split(" at ")[0]] += 1
                        if len(stats.bad_examples) < 10:
                            stats.bad_examples.append(f"{where(fi, loc)}: {reason}")
                try:
                    for a in arrays:
                        writer.add_document(a)
                except OSError as e:  # disk full, quota, a vanished mount
                    raise _cannot_write(args.output, e) from None
                stats.empty += empty
                stats.bytes += nbytes
                elapsed = max(time.time() - t0, 1e-9)
                progress.update(task, advance=nbytes, docs=writer.documents, tokens=writer.tokens,
                                tps=writer.tokens / elapsed)
        finally:
            if pool is not None:
                pool.terminate()
                pool.join()
        stats.documents, stats.tokens = writer.documents, writer.tokens
        if stats.documents == 0 and (job.shard is None or stats.bad_total or stats.empty):
            _error(f"no documents in the input: {_nothing_kept(stats)}; no output written")
            return ExitCode.BAD_INPUT
        if stats.documents == 0:  # a shard that the split left without records: complete, empty
            err.print(f"{prefix}: shard {job.shard[0]}/{job.shard[1]} has no records "
                      f"(more shards than splittable input); written empty", markup=False, highlight=False)
        elapsed = time.time() - t0
        sidecar = {
            "inputs": sorted({files[p.file] for p in job.pieces}, key=files.index), "documents": stats.documents, "tokens": stats.tokens,
            "bytes": stats.bytes, "empty_documents": stats.empty, "bad_records": dict(stats.bad),
            "bad_examples": stats.bad_examples, "tokenizer": os.path.abspath(spec.path),
            "tokenizer_sha256": spec.sha256, "vocab_size": tok.get_vocab_size(), "eod_id": spec.eod,
            "eod_token": spec.eod_token, "bos_id": spec.bos,
            "dtype": np.dtype(writer.dtype).name, "json_key": args.json_key, "seconds": round(elapsed, 2),
            **job.expected, "pieces": pieces,
        }
        try:
            writer.commit(sidecar, before_rename=lambda: _refuse_if_changed(
                args, job, "while this run was tokenizing"))
        except OSError as e:
            raise _cannot_write(args.output, e) from None
    _report(out, prefix, stats, elapsed, spec.path)
    return ExitCode.OK


def _nothing_kept(stats: Stats) -> str:
    """Why no document was kept: every record invalid or empty, with the counts."""
    if stats.bad_total:
        reasons = ", ".join(f"{n:,} {reason}" for reason, n in sorted(stats.bad.items()))
        empty = f" and {stats.empty:,} empty" if stats.empty else ""
        return (f"all {stats.bad_total + stats.empty:,} records were dropped, "
                f"{stats.bad_total:,} as invalid ({reasons}){empty}; first: {stats.bad_examples[0]}")
    if stats.empty:
        return f"all {stats.empty:,} records were empty"
    return "the input files hold no records"


def _progress(enabled: bool, console):
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(
        TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>5.1f}%"),
        TextColumn("{task.fields[docs]:,} docs"), TextColumn("{task.fields[tokens]:,} tok"),
        TextColumn("{task.fields[tps]:,.0f} tok/s"), TimeElapsedColumn(), TimeRemainingColumn(),
        console=console, disable=not enabled,
    )


def _report(console, prefix: str, stats: Stats, elapsed: float, tok_path: str) -> None:
    from rich.table import Table

    t = Table(title=f"data.prepare -> {prefix}", show_header=False)
    t.add_column(style="bold")
    t.add_column(justify="right")
    t.add_row("documents", f"{stats.documents:,}")
    t.add_row("tokens", f"{stats.tokens:,}")
    t.add_row("tokens / document", f"{stats.tokens / max(stats.documents, 1):,.1f}")
    t.add_row("input bytes", f"{stats.bytes:,}")
    t.add_row("empty documents skipped", f"{stats.empty:,}")
    t.add_row("bad records skipped", f"{stats.bad_total:,}")
    for reason, n in sorted(stats.bad.items()):
        t.add_row(f"  {reason}", f"{n:,}")
    t.add_row("time", f"{elapsed:.2f} s")
    t.add_row("tokens / s", f"{stats.tokens / max(elapsed, 1e-9):,.0f}")
    t.add_row("tokenizer", tok_path)
    t.add_row("output", f"{prefix}.bin, {prefix}.idx, {prefix}.json")
    console.print(t)
    for ex in stats.bad_examples:
        console.print(f"bad: {ex}", soft_wrap=True, markup=False, highlight=False)


if __name__ == "__main__":
    sys.exit(main())

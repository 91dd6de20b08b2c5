"""Decode, validate and encode batches of records: in the pool's worker processes, or in-process
with ``--workers 1``.

A worker process is started with ``spawn`` and imports this module (and what it imports), not the
command: init_worker sets its tokenizer and options once, encode_batch turns a batch of raw records
into token arrays and the bad records' reasons. bounded_imap keeps the batches in flight to a
window, so memory stays bounded however fast the input is read.
"""

from __future__ import annotations

import collections
import json
import os
from typing import Iterator, List, Optional, Tuple

import numpy as np

from data.prepare.readers import Record
from data.tokenizer import TokenizerSpec


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


def arrow_texts(arr, column: str) -> List[Tuple[Optional[str], Optional[str]]]:
    """(text, None) or (None, reason) per value of a string array."""
    try:
        vals = arr.to_pylist()
    except UnicodeDecodeError:  # Arrow strings are meant to be UTF-8; a writer may not have checked
        import pyarrow as pa  # optional dependency: only Parquet/Arrow records get here

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


_W = {}


def init_worker(tokenizer_init: tuple, kinds: List[str], json_key: str, text_column: str,
                single_thread: bool) -> None:
    if single_thread:
        os.environ["RAYON_NUM_THREADS"] = "1"  # read when the tokenizer first encodes, not on import
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
            for k, (text, reason) in enumerate(arrow_texts(payload, _W["text_column"])):
                take(fi, loc + k, text, reason)
    arrays = [np.asarray(ids, dtype=np.int32) for ids in _W["spec"].encode_documents(texts)]
    return arrays, bad, empty, nbytes


def bounded_imap(pool, fn, items: Iterator, window: int):
    """pool.imap in order, with at most ``window`` items read ahead: memory stays bounded however
    fast the input is read."""
    pending = collections.deque()
    for item in items:
        pending.append(pool.apply_async(fn, (item,)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()

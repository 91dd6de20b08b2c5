"""Which files the inputs name, and in what format.

Inputs are files, directories (walked in sorted order) or globs; a directory written by
``datasets.Dataset.save_to_disk`` stands for its Arrow files. A file's format comes from its
extension (``.gz`` read through): JSON lines, Parquet, Arrow, else plain text. A Parquet/Arrow file
is refused here, before anything is written, when it has no string column to read.

pyarrow is imported inside the functions that need it: it is an optional dependency (the ``hf``
extra), and a run over JSON lines or text never loads it.
"""

from __future__ import annotations

import glob
import json
import os
from typing import List, Optional, Sequence

from data.prepare.refusals import UsageError

JSON_EXTS = (".jsonl", ".ndjson", ".json")
PARQUET_EXTS = (".parquet", ".pq")
ARROW_EXTS = (".arrow",)
TABULAR = ("parquet", "arrow")
HF_STATE = "state.json"  # what datasets.Dataset.save_to_disk writes next to its Arrow files
HF_DICT = "dataset_dict.json"  # ... and DatasetDict.save_to_disk above its splits


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


def arrow_reader(source):
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
                schema = arrow_reader(mm).schema
    except (pa.ArrowException, OSError) as e:
        raise UsageError(f"{path}: cannot read it as {kind} ({e})") from None
    if column not in schema.names:
        raise UsageError(f"{path} has no column {column!r} (columns: {', '.join(schema.names)}): "
                         f"choose one with --text-column")
    t = schema.field(column).type
    if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)):
        raise UsageError(f"{path}: column {column!r} is {t}, not a string column: choose one with --text-column")

"""Tokenize JSONL / plain text into a megatron-core indexed dataset (.bin/.idx).

    python -m data.prepare corpus/*.jsonl --tokenizer tok/tokenizer.json --output out/web --workers 4
    python -m data.prepare 'books/**/*.txt' --train-tokenizer 32768 --output out/books

Inputs: files or globs (quote globs for ``**``); ``.gz`` is read transparently. ``.jsonl``,
``.ndjson`` and ``.json`` files hold one JSON object per line with the text under ``--json-key``
(default ``text``); other files are plain UTF-8 text, one document per file (``--text-doc file``),
per line (``line``) or per blank-line-separated paragraph (``paragraph``). Every document is
tokenized and ends with the tokenizer's ``<|endoftext|>`` token.

Bad input (malformed JSON, missing/non-string field, invalid UTF-8) is skipped, counted and
reported with file:line; ``--strict`` stops at the first one (exit 1); when every record is
dropped, the "no documents" error gives the counts per reason. The dataset is written under a
temporary name carrying the writer's pid and host and renamed into place at the end (.bin first,
then .idx), so an interrupted run never leaves a dataset that looks complete; the temporaries of
a run that was killed (SIGKILL, node loss) are removed by the next run on the same output. An
existing output is refused unless ``--overwrite``.
A sidecar ``PREFIX.json`` records the statistics and the tokenizer's hash.

``--train-tokenizer VOCAB`` first trains a byte-level BPE on the input documents and saves it as
``tokenizer.json`` in the output's directory.

Exit codes: 0 done; 1 bad input under --strict, no documents, or an error while writing;
2 usage errors (bad arguments, no inputs, output exists without --overwrite).
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import multiprocessing as mp
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np

JSON_EXTS = (".jsonl", ".ndjson", ".json")
Record = Tuple[int, int, bytes]  # (file index, 1-based line number, raw bytes)


class StrictError(Exception):
    pass


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
# reading


def expand_inputs(patterns: Sequence[str]) -> List[str]:
    files: List[str] = []
    for pat in patterns:
        if os.path.isdir(pat):
            matches = sorted(p for p in glob.glob(os.path.join(pat, "**", "*"), recursive=True) if os.path.isfile(p))
        elif any(ch in pat for ch in "*?["):
            matches = sorted(p for p in glob.glob(pat, recursive=True) if os.path.isfile(p))
        else:
            matches = [pat] if os.path.isfile(pat) else []
        if not matches:
            raise FileNotFoundError(f"no input file matches {pat!r}")
        files.extend(matches)
    return list(dict.fromkeys(files))


def file_format(path: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    base = path[:-3] if path.endswith(".gz") else path
    return "jsonl" if base.endswith(JSON_EXTS) else "text"


def _open(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def iter_records(files: Sequence[str], fmt: str, text_doc: str) -> Iterator[Record]:
    """Raw records in input order. Bytes stay undecoded: decoding/validation happens in workers."""
    for fi, path in enumerate(files):
        kind = file_format(path, fmt)
        with _open(path) as f:
            if kind == "jsonl" or text_doc == "line":
                for ln, line in enumerate(f, 1):
                    if line.strip():
                        yield fi, ln, line
            elif text_doc == "file":
                yield fi, 1, f.read()
            else:  # paragraph
                buf: List[bytes] = []
                start = 1
                for ln, line in enumerate(f, 1):
                    if line.strip():
                        if not buf:
                            start = ln
                        buf.append(line)
                    elif buf:
                        yield fi, start, b"".join(buf)
                        buf = []
                if buf:
                    yield fi, start, b"".join(buf)


def parse_record(raw: bytes, kind: str, json_key: str) -> Tuple[Optional[str], Optional[str]]:
    """-> (text, None) or (None, reason)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"invalid UTF-8 at byte {e.start}"
    if kind == "text":
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


def batched(records: Iterator[Record], max_bytes: int) -> Iterator[List[Record]]:
    batch: List[Record] = []
    size = 0
    for rec in records:
        batch.append(rec)
        size += len(rec[2])
        if size >= max_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


# ----------------------------------------------------------------------------------------------
# worker side (also run in-process with --workers 1)

_W = {}


def _init_worker(tokenizer_json: str, kinds: List[str], json_key: str, single_thread: bool) -> None:
    if single_thread:
        os.environ["RAYON_NUM_THREADS"] = "1"
    from tokenizers import Tokenizer

    from data.tokenizer import eod_id

    tok = Tokenizer.from_str(tokenizer_json)
    _W.update(tok=tok, eod=eod_id(tok), kinds=kinds, json_key=json_key)


def encode_batch(batch: List[Record]):
    """-> (token arrays, bad [(file, line, reason)], empty count, bytes)."""
    texts, bad, empty, nbytes = [], [], 0, 0
    for fi, ln, raw in batch:
        nbytes += len(raw)
        text, reason = parse_record(raw, _W["kinds"][fi], _W["json_key"])
        if reason is not None:
            bad.append((fi, ln, reason))
        elif not text.strip():
            empty += 1
        else:
            texts.append(text)
    eod = _W["eod"]
    arrays = [np.asarray(e.ids + [eod], dtype=np.int32) for e in _W["tok"].encode_batch(texts)]
    return arrays, bad, empty, nbytes


# ----------------------------------------------------------------------------------------------
# main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m data.prepare",
        description="Tokenize JSONL or text into a megatron-core indexed dataset (.bin/.idx).",
    )
    p.add_argument("inputs", nargs="+", help="input files, directories or globs")
    p.add_argument("--output", "-o", required=True, help="output prefix (writes PREFIX.bin, PREFIX.idx, PREFIX.json)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--tokenizer", help="HF tokenizers tokenizer.json (must contain <|endoftext|>)")
    g.add_argument("--train-tokenizer", type=int, metavar="VOCAB",
                   help="train a byte-level BPE of this vocab size on the input; saved as tokenizer.json next to the output")
    p.add_argument("--json-key", default="text", help="JSON field holding the text (default: text)")
    p.add_argument("--format", choices=["auto", "jsonl", "text"], default="auto",
                   help="input format; auto = by extension (.jsonl/.ndjson/.json[.gz] = JSONL, else text)")
    p.add_argument("--text-doc", choices=["file", "line", "paragraph"], default="file",
                   help="plain text: one document per file, line, or blank-line-separated paragraph")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    p.add_argument("--batch-bytes", type=int, default=1 << 20, help="input bytes per work item (default 1 MiB)")
    p.add_argument("--strict", action="store_true", help="fail on the first bad record (exit 1)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output (and tokenizer.json)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    from rich.console import Console

    args = build_parser().parse_args(argv)
    err = Console(stderr=True)
    out = Console()
    if args.workers < 1:
        _error("--workers must be >= 1")
        return 2
    prefix = os.path.abspath(os.path.expanduser(args.output))
    try:
        files = expand_inputs(args.inputs)
    except FileNotFoundError as e:
        _error(f"{e}")
        return 2
    if not args.overwrite:
        existing = [prefix + e for e in (".bin", ".idx") if os.path.exists(prefix + e)]
        if args.train_tokenizer and os.path.exists(_tokenizer_out(prefix)):
            existing.append(_tokenizer_out(prefix))
        if existing:
            _error(f"refusing to overwrite {', '.join(existing)} (pass --overwrite)")
            return 2
    kinds = [file_format(f, args.format) for f in files]
    try:
        return _run(args, files, kinds, prefix, out, err)
    except StrictError as e:
        _error(f"{e} (--strict); no output written")
        return 1
    except KeyboardInterrupt:
        _error("interrupted: no output written")
        return 130


def _error(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr, flush=True)  # unwrapped: file:line stays greppable


def _tokenizer_out(prefix: str) -> str:
    return os.path.join(os.path.dirname(prefix), "tokenizer.json")


def _run(args, files, kinds, prefix, out, err) -> int:
    from data.indexed import IndexedWriter, mcore
    from data.tokenizer import load_tokenizer, save_tokenizer_atomic, tokenizer_sha256, train_bpe_tokenizer

    mcore()  # import megatron-core (~7 s) before the clock starts
    t0 = time.time()
    if args.train_tokenizer:
        def texts():
            for fi, ln, raw in iter_records(files, args.format, args.text_doc):
                text, reason = parse_record(raw, kinds[fi], args.json_key)
                if reason is not None and args.strict:
                    raise StrictError(f"{files[fi]}:{ln}: {reason}")
                if text and text.strip():
                    yield text

        with err.status(f"training a {args.train_tokenizer}-token BPE tokenizer on {len(files)} file(s)"):
            tok = train_bpe_tokenizer(texts(), args.train_tokenizer)
        tok_path = _tokenizer_out(prefix)
        save_tokenizer_atomic(tok, tok_path)
        err.print(f"tokenizer ({tok.get_vocab_size()} tokens) saved to {tok_path}")
    else:
        tok_path = os.path.abspath(args.tokenizer)
        try:
            tok = load_tokenizer(tok_path)
        except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception
            _error(f"cannot load tokenizer {args.tokenizer!r}: {e}")
            return 2

    stats = Stats()
    total_bytes = None if any(f.endswith(".gz") for f in files) else sum(os.path.getsize(f) for f in files)
    batches = batched(iter_records(files, args.format, args.text_doc), args.batch_bytes)
    init = (tok.to_str(), kinds, args.json_key)
    with IndexedWriter(prefix, tok.get_vocab_size(), overwrite=args.overwrite) as writer, \
            _progress(not args.no_progress, err) as progress:
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
            results = pool.imap(encode_batch, batches, chunksize=1)
        try:
            for arrays, bad, empty, nbytes in results:
                if bad:
                    for fi, ln, reason in bad:
                        where = f"{files[fi]}:{ln}: {reason}"
                        if args.strict:
                            raise StrictError(where)
                        stats.bad[reason.split(" (")[0].split(" at ")[0]] += 1
                        if len(stats.bad_examples) < 10:
                            stats.bad_examples.append(where)
                for a in arrays:
                    writer.add_document(a)
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
        if stats.documents == 0:
            _error(f"no documents in the input: {_nothing_kept(stats)}; no output written")
            return 1
        elapsed = time.time() - t0
        sidecar = {
            "inputs": files, "documents": stats.documents, "tokens": stats.tokens, "bytes": stats.bytes,
            "empty_documents": stats.empty, "bad_records": dict(stats.bad), "bad_examples": stats.bad_examples,
            "tokenizer": tok_path, "tokenizer_sha256": tokenizer_sha256(tok), "vocab_size": tok.get_vocab_size(),
            "dtype": np.dtype(writer.dtype).name, "json_key": args.json_key, "seconds": round(elapsed, 2),
        }
        writer.commit(sidecar)
    _report(out, prefix, stats, elapsed, tok_path)
    return 0


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

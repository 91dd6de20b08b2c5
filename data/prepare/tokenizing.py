"""The tokenizing pass of one run: train a tokenizer if asked, read the pieces, encode them in the
workers, write the indexed dataset and commit it with its sidecar, report.

cli.main calls tokenize() once plan() (job.py) has accepted the run and the output's lock is held.
Bad records are counted, the first ten located as file:line (_Locator); under --strict the first
is a StrictError. The writer (data.indexed.IndexedWriter) keeps everything under temporary names
until the commit, which refuse_if_changed guards: a refusal anywhere leaves nothing.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from errors import ExitCode

from data.indexed import IndexedWriter, mcore
from data.prepare.inputs import TABULAR
from data.prepare.job import Job, piece_records, refuse_if_changed, tokenizer_out
from data.prepare.readers import batched, iter_records
from data.prepare.refusals import NOTHING_WRITTEN, StrictError, UsageError, cannot_write, print_error
from data.prepare.workers import arrow_texts, bounded_imap, encode_batch, init_worker, parse_record
from data.tokenizer import load_tokenizer_spec, save_tokenizer_atomic, train_bpe_tokenizer


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


def tokenize(args, job: Job) -> int:
    """The run that plan() accepted, under the output's lock: ExitCode.OK, or BAD_INPUT when no
    document was kept. A refusal is raised (refusals.py), and nothing is written."""
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
                        results = [(loc + k, t, r) for k, (t, r) in enumerate(arrow_texts(payload, args.text_column))]
                    for at, text, reason in results:
                        if reason is not None and args.strict:
                            raise StrictError(f"{where(fi, at)}: {reason} (--strict)"
                                              f"{NOTHING_WRITTEN}")
                        if text and text.strip():
                            yield text

        with err.status(f"training a {args.train_tokenizer}-token BPE tokenizer on {len(files)} file(s)"):
            tok = train_bpe_tokenizer(texts(), args.train_tokenizer)
        tok_path = tokenizer_out(prefix)
        if not args.overwrite and os.path.exists(tok_path):  # plan() saw none: it appeared since
            raise UsageError(f"refusing to overwrite {tok_path}: it appeared while this run "
                             "trained its tokenizer (pass --overwrite)")
        try:
            save_tokenizer_atomic(tok, tok_path)
        except OSError as e:
            raise cannot_write(args.output, e) from None
        err.print(f"tokenizer ({tok.get_vocab_size()} tokens) saved to {tok_path}")
        job.spec = load_tokenizer_spec(tok_path)
        job.expected["tokenizer_sha256"] = job.spec.sha256
    spec = job.spec
    tok = spec.tokenizer

    stats = Stats()
    gz = any(files[p.file].endswith(".gz") for p in job.pieces)
    total_bytes = None if gz else sum(p.end - p.start for p in job.pieces)
    pieces = piece_records(job)  # the bytes this run reads, hashed: lets a re-run skip a complete shard
    batches = batched(iter_records(files, kinds, job.pieces, args.text_doc, args.text_column, args.batch_bytes),
                      args.batch_bytes)
    init = (spec.to_init(), kinds, args.json_key, args.text_column)
    try:  # what may be replaced was decided in plan(); refuse_if_changed holds it to that
        writer = IndexedWriter(prefix, tok.get_vocab_size(), overwrite=True)
    except OSError as e:
        raise cannot_write(args.output, e) from None
    with writer, _progress(not args.no_progress, err) as progress:
        for path in writer.removed_stale:
            err.print(f"removed {path}: a temporary of a data.prepare that was killed",
                      soft_wrap=True, markup=False, highlight=False)
        task = progress.add_task("tokenizing", total=total_bytes, docs=0, tokens=0, tps=0.0)
        if args.workers == 1:
            init_worker(*init, single_thread=False)
            results = map(encode_batch, batches)
            pool = None
        else:
            pool = mp.get_context("spawn").Pool(args.workers, initializer=init_worker, initargs=(*init, True))
            results = bounded_imap(pool, encode_batch, batches, window=2 * args.workers + 2)
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
                    raise cannot_write(args.output, e) from None
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
            print_error(f"no documents in the input: {_nothing_kept(stats)}; no output written")
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
            writer.commit(sidecar, before_rename=lambda: refuse_if_changed(
                args, job, "while this run was tokenizing"))
        except OSError as e:
            raise cannot_write(args.output, e) from None
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
    return Progress(
        TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>5.1f}%"),
        TextColumn("{task.fields[docs]:,} docs"), TextColumn("{task.fields[tokens]:,} tok"),
        TextColumn("{task.fields[tps]:,.0f} tok/s"), TimeElapsedColumn(), TimeRemainingColumn(),
        console=console, disable=not enabled,
    )


def _report(console, prefix: str, stats: Stats, elapsed: float, tok_path: str) -> None:
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

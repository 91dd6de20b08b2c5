"""The command, ``python -m data.prepare``: its arguments, the output's lock, signals and exit codes.

main() either checks datasets (``--check``, data/check.py) or prepares one: plan() (job.py) refuses
what it can before anything is written, then, holding ``PREFIX.lock``, tokenize() (tokenizing.py)
writes. Every refusal is a ProjectError (refusals.py) that main prints as one ``error:`` line and
returns its exit code for; Ctrl-C and SIGTERM unwind through the writer, so that nothing is left.
"""

from __future__ import annotations

import argparse
import signal
import threading
from typing import Optional, Sequence

from errors import ExitCode, ProjectError

from data.check import check_prefixes
from data.indexed import PrefixLock
from data.prepare.job import plan, refuse_if_changed
from data.prepare.refusals import cannot_write, print_error
from data.prepare.tokenizing import tokenize


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


class Terminated(BaseException):
    """SIGTERM (Slurm's scancel or time limit): unwind so that the temporaries are removed."""


def _on_sigterm(signum, frame):
    raise Terminated()


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.check:
        if not args.inputs:
            print_error("--check needs at least one dataset prefix")
            return ExitCode.CONFIG
        return check_prefixes(args.inputs, workers=args.workers)
    try:
        job = plan(args)
    except ProjectError as e:
        print_error(str(e))
        return e.code
    if job is None:  # a complete shard: nothing to do
        return ExitCode.OK
    in_main = threading.current_thread() is threading.main_thread()  # signal() works only there
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if in_main else None
    lock = PrefixLock(job.prefix)
    try:
        try:
            lock.acquire()  # the first write: held until the output is committed or abandoned
        except OSError as e:
            raise cannot_write(args.output, e) from None
        refuse_if_changed(args, job, "since this run started")
        return tokenize(args, job)
    except ProjectError as e:  # each refusal carries its exit code
        print_error(str(e))
        return e.code
    except KeyboardInterrupt:
        print_error("interrupted: no output written")
        return ExitCode.INTERRUPTED
    except Terminated:
        print_error("terminated (SIGTERM): no output written")
        return ExitCode.TERMINATED
    finally:
        lock.release()
        if in_main:
            signal.signal(signal.SIGTERM, previous)

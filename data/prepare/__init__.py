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

The package, one concern per module; each imports only modules listed above it (no circle):

    refusals.py    the refusals (each a ProjectError with its exit code) and their ``error:`` line
    inputs.py      which files the inputs name, and their formats; Parquet/Arrow columns checked
    pieces.py      which bytes of which file this run (or shard) reads, and their SHA-256
    readers.py     those pieces' records in order, undecoded: lines, paragraphs, row-group slices
    workers.py     decode, validate and encode a batch, in a worker process or in-process
    job.py         plan(): everything refusable refused before a write; the output's state and
                   the sidecar's record of the work; a complete shard skipped
    tokenizing.py  the pass: train a tokenizer if asked, encode, write, commit, report
    cli.py         the command: arguments, the output's lock, signals, exit codes
    __main__.py    ``python -m data.prepare``

This ``__init__`` re-exports the refusals alone (``data.prepare.UsageError`` and the others: the
errors a run ends with, by the names tests/test_errors.py checks their exit codes) and imports no
other module of the package: a worker process, which imports workers.py, loads neither the
command, nor Rich, nor the dataset writer.
"""

from data.prepare.refusals import InputError, OutputError, StrictError, UsageError

__all__ = ["InputError", "OutputError", "StrictError", "UsageError"]

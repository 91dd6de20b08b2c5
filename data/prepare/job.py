"""What one run writes, and whether it may: everything that can be refused is refused here, before
anything is written.

plan() checks the arguments, expands and checks the inputs, loads the tokenizer and plans the
pieces; the Job it returns says where the run writes, what the output held when planned (which
refuse_if_changed holds the run to at the lock and at the commit), and the sidecar's record of the
work. A shard that is already complete and was made from the same work is skipped (plan() returns
None); one made otherwise, or shards of another split beside it, are refused.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from data.check import index_problem
from data.prepare.inputs import TABULAR, check_text_column, expand_inputs, file_format
from data.prepare.pieces import Piece, piece_sha256, plan_pieces
from data.prepare.refusals import UsageError
from data.shards import dataset_problem, find_shards, read_json, shard_info, shard_prefix
from data.tokenizer import load_tokenizer_spec


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


def parse_shard(value: str) -> Tuple[int, int]:
    try:
        i, n = (int(x) for x in value.split("/"))
    except ValueError:
        raise UsageError(f"--shard {value!r}: expected I/N with integers, e.g. 3/64") from None
    if not (n >= 1 and 0 <= i < n):
        raise UsageError(f"--shard {value!r}: need 0 <= I < N")
    return i, n


def plan(args) -> Optional[Job]:
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
        if args.train_tokenizer and os.path.exists(tokenizer_out(prefix)):
            existing.append(tokenizer_out(prefix))
        if existing:
            raise UsageError(f"refusing to overwrite {', '.join(existing)} (pass --overwrite)")
    return job


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


def refuse_if_changed(args, job: Job, when: str) -> None:
    """Without --overwrite, the output must still be what plan() accepted (usually nothing): a
    dataset that another writer put there meanwhile is never replaced."""
    if not args.overwrite and _output_state(job.prefix) != job.found:
        raise UsageError(f"refusing to overwrite {job.prefix}: a dataset appeared there {when} "
                         "(another writer); nothing was replaced (pass --overwrite to replace it)")


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
    pieces = piece_records(job)
    if meta.get("pieces") != pieces:
        bad = [p["path"] for p in pieces if p not in meta.get("pieces", [])]
        return "from inputs whose content changed: " + ", ".join(bad[:3] or ["(pieces differ)"])
    return None


def piece_records(job: Job) -> List[Dict]:
    """What this run reads: per file, the byte range and its SHA-256."""
    return [{"path": job.files[p.file], "size": os.path.getsize(job.files[p.file]), "start": p.start,
             "end": p.end, "sha256": piece_sha256(job.files[p.file], p)} for p in job.pieces]


def tokenizer_out(prefix: str) -> str:
    return os.path.join(os.path.dirname(prefix), "tokenizer.json")

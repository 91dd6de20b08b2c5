"""The embedded demo corpus: three categories, the same bytes on every Python version.

- ``prose``: English prose about Python, CPython 3.11.7's ``pydoc_data.topics`` (79 topics,
  ~465 KB), one document per topic.
- ``code``: CPython 3.11.7's top-level standard-library ``*.py`` files in name order, one document
  per file, capped at ``DemoConfig.code_max_bytes`` (default 2 MB of the ~4.7 MB: the files in
  name order up to the cap) so that preparation stays fast.
- ``math``: generated arithmetic worksheets ("12 + 7 = 19", word problems, ...), deterministic
  from ``DemoConfig.seed``.

Prose and code come from the snapshot in ``data/demo_corpus/`` (``data.demo_snapshot``), not from
the running interpreter, whose texts differ per version: so the corpus key, the tokens and the
golden losses are the same on Python 3.11 and 3.12.

A byte-level BPE tokenizer (HF ``tokenizers``, ``<|endoftext|>`` = id 0) is trained on the
training documents; each category becomes a megatron-core indexed dataset ``<cat>`` and the last
``val_fraction`` of its documents (by bytes) a held-out dataset ``<cat>_val``.

Everything lands in ``<cache_dir>/demo-<key>/`` where ``key`` hashes the input texts and the
settings: a second call finds it and returns at once. The directory is written under a temporary
name and renamed into place, so it is complete whenever it exists; when two processes race, the
loser discards its copy and uses the winner's.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

import numpy as np
import tokenizers

from atomic_files import remove_dead_temporaries, writer_tag

from data import demo_snapshot
from data.config import DEMO_CATEGORIES, DemoConfig
from data.indexed import mcore, quiet_megatron_logs, token_dtype
from data.tokenizer import EOD_TOKEN, eod_id, train_bpe_tokenizer

FORMAT_VERSION = 1
BUILD_COUNT = 0  # how many times this process actually built a demo corpus (tests read it)


@dataclass
class DemoCorpus:
    path: str  # directory holding tokenizer.json, <cat>.bin/.idx, <cat>_val.bin/.idx
    key: str
    built: bool  # False when it came from the cache
    manifest: Dict

    @property
    def tokenizer_path(self) -> str:
        return os.path.join(self.path, "tokenizer.json")


# ----------------------------------------------------------------------------------------------
# raw documents


def prose_documents() -> List[str]:
    return [text for _, text in demo_snapshot.load()["prose"] if text.strip()]


def code_documents(max_bytes: int) -> List[str]:
    """The snapshot's files in name order while their total stays within ``max_bytes``."""
    docs, total = [], 0
    for _, text in demo_snapshot.load()["code"]:
        size = len(text.encode("utf-8"))
        if total + size > max_bytes:
            break
        if not text.strip():
            continue
        docs.append(text)
        total += size
    return docs


_NAMES = ["Ada", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo"]
_ITEMS = ["apples", "marbles", "books", "coins", "stamps", "shells", "cards", "pencils"]


def _problem(kind: str, rng: random.Random) -> str:
    if kind == "addition":
        a, b = rng.randint(0, 10 ** rng.randint(1, 4)), rng.randint(0, 10 ** rng.randint(1, 4))
        return f"{a} + {b} = {a + b}"
    if kind == "subtraction":
        a, b = sorted((rng.randint(0, 9999), rng.randint(0, 9999)), reverse=True)
        return f"{a} - {b} = {a - b}"
    if kind == "multiplication":
        a, b = rng.randint(2, 10 ** rng.randint(1, 2)), rng.randint(2, 99)
        return f"{a} * {b} = {a * b}"
    if kind == "division":
        b = rng.randint(2, 50)
        a = rng.randint(b, 2000)
        q, r = divmod(a, b)
        return f"{a} / {b} = {q} remainder {r}"
    if kind == "mixed":
        a, b, c = rng.randint(1, 99), rng.randint(1, 99), rng.randint(2, 12)
        if rng.random() < 0.5:
            return f"({a} + {b}) * {c} = {a + b} * {c} = {(a + b) * c}"
        return f"{a} * {c} - {b} = {a * c} - {b} = {a * c - b}"
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b = rng.randint(2, 60), rng.randint(1, 40)
    if rng.random() < 0.5:
        return (f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now? "
                f"{a} + {b} = {a + b}. Answer: {a + b}")
    a = a + b
    return (f"{name} has {a} {item} and gives away {b}. How many {item} are left? "
            f"{a} - {b} = {a - b}. Answer: {a - b}")


def math_documents(n_docs: int, seed: int) -> List[str]:
    rng = random.Random(seed)
    kinds = ["addition", "subtraction", "multiplication", "division", "mixed", "word problems"]
    docs = []
    for d in range(n_docs):
        kind = rng.choice(kinds)
        lines = [f"Worksheet {d + 1}: {kind}"]
        lines += [f"{q + 1}. {_problem(kind, rng)}" for q in range(rng.randint(6, 16))]
        docs.append("\n".join(lines) + "\n")
    return docs


def raw_documents(cfg: DemoConfig) -> Dict[str, List[str]]:
    return {
        "prose": prose_documents(),
        "code": code_documents(cfg.code_max_bytes),
        "math": math_documents(cfg.math_documents, cfg.seed),
    }


def corpus_key(cfg: DemoConfig, docs: Dict[str, List[str]]) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"format": FORMAT_VERSION, "settings": asdict(cfg),
                         "tokenizers": tokenizers.__version__}, sort_keys=True).encode())
    for cat in DEMO_CATEGORIES:
        for d in docs[cat]:
            h.update(hashlib.sha256(d.encode("utf-8")).digest())
        h.update(b"|")
    return h.hexdigest()[:16]


def split_train_val(docs: List[str], val_fraction: float):
    """Hold out the shortest suffix of documents holding >= val_fraction of the bytes."""
    sizes = [len(d.encode("utf-8")) for d in docs]
    target, acc, n_val = val_fraction * sum(sizes), 0, 0
    while acc < target and n_val < len(docs) - 1:
        n_val += 1
        acc += sizes[-n_val]
    n_val = max(n_val, 1)
    return docs[:-n_val], docs[-n_val:]


# ----------------------------------------------------------------------------------------------
# build


def ensure_demo_corpus(cache_dir: str, cfg: Optional[DemoConfig] = None, show_progress: bool = False) -> DemoCorpus:
    """Return the demo corpus under ``cache_dir``, building it first if it is not there."""
    cfg = cfg or DemoConfig()
    docs = raw_documents(cfg)
    key = corpus_key(cfg, docs)
    final = os.path.join(cache_dir, f"demo-{key}")
    if os.path.isfile(os.path.join(final, "manifest.json")):
        return _load(final, key, built=False)
    os.makedirs(cache_dir, exist_ok=True)
    remove_dead_temporaries(os.path.join(glob.escape(cache_dir), ".tmp-demo-*"))  # killed builds
    tmp = os.path.join(cache_dir, f".tmp-demo-{key}-{writer_tag()}")
    try:
        _build(tmp, key, cfg, docs, show_progress)
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isfile(os.path.join(final, "manifest.json")):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # lost the race: use the winner's copy
            return _load(final, key, built=False)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    global BUILD_COUNT
    BUILD_COUNT += 1
    return _load(final, key, built=True)


def _load(path: str, key: str, built: bool) -> DemoCorpus:
    with open(os.path.join(path, "manifest.json"), encoding="utf-8") as f:
        return DemoCorpus(path=path, key=key, built=built, manifest=json.load(f))


def _build(out: str, key: str, cfg: DemoConfig, docs: Dict[str, List[str]], show_progress: bool) -> None:
    t0 = time.time()
    os.makedirs(out)
    splits = {cat: split_train_val(docs[cat], cfg.val_fraction) for cat in DEMO_CATEGORIES}
    n_steps = 1 + 2 * len(DEMO_CATEGORIES)
    with _progress(show_progress) as progress:
        task = progress.add_task(f"demo corpus: training BPE tokenizer (vocab {cfg.vocab_size})", total=n_steps)
        train_texts = [d for cat in DEMO_CATEGORIES for d in splits[cat][0]]
        tok = train_bpe_tokenizer(train_texts, cfg.vocab_size, length=len(train_texts))
        tok.save(os.path.join(out, "tokenizer.json"))
        progress.advance(task)
        eod = eod_id(tok)
        dtype = token_dtype(tok.get_vocab_size())
        stats = {}
        for cat in DEMO_CATEGORIES:
            for name, part in ((cat, splits[cat][0]), (f"{cat}_val", splits[cat][1])):
                progress.update(task, description=f"demo corpus: tokenizing {name} ({len(part)} documents)")
                with quiet_megatron_logs():
                    builder = mcore().IndexedDatasetBuilder(os.path.join(out, name + ".bin"), dtype=dtype)
                    n_tok = 0
                    for enc in tok.encode_batch(part):
                        ids = np.asarray(enc.ids + [eod], dtype=dtype)
                        builder.add_document(ids, [len(ids)])
                        n_tok += len(ids)
                    builder.finalize(os.path.join(out, name + ".idx"))
                stats[name] = {"documents": len(part), "tokens": n_tok,
                               "bytes": sum(len(d.encode("utf-8")) for d in part)}
                progress.advance(task)
        progress.update(task, description="demo corpus: done")
    manifest = {
        "format": FORMAT_VERSION, "key": key, "settings": asdict(cfg), "vocab_size": tok.get_vocab_size(),
        "eod_token": EOD_TOKEN, "eod_id": eod, "datasets": stats, "build_seconds": round(time.time() - t0, 2),
        "sources": {"prose": f"pydoc_data.topics of CPython {demo_snapshot.SNAPSHOT_PYTHON} (data/demo_corpus/)",
                    "code": f"Lib/*.py of CPython {demo_snapshot.SNAPSHOT_PYTHON} (data/demo_corpus/)",
                    "math": f"generated, seed {cfg.seed}"},
    }
    with open(os.path.join(out, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)


@contextlib.contextmanager
def _progress(enabled: bool):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=Console(stderr=True), disable=not enabled,
                        transient=False)
    with progress:
        yield progress

"""The demo corpus's raw texts, frozen: a compressed snapshot of CPython 3.11.7's, kept in the repository.

The demo corpus trains on English prose about Python (``pydoc_data.topics``) and the standard
library's top-level ``*.py`` files. Read from the running interpreter, those texts change with
every Python version, and with them the corpus key, the tokens and the golden losses (the
golden test could not compare on Python 3.12). So ``data.demo`` reads them from
``data/demo_corpus/cpython-3.11.7-texts.json.xz`` (PSF License, see data/demo_corpus/NOTICE), the
same texts on every Python.

The snapshot was written once, on CPython 3.11.7, by

    python -m data.demo_snapshot --write

which keeps every topic (in name order) and every top-level ``*.py`` file that reads as UTF-8 (in
name order, all of them: ``DemoConfig.code_max_bytes`` picks the prefix). Running it again on any
other Python refuses, so the texts change only on purpose.
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import lzma
import os
import platform
import sys
import sysconfig
from typing import Dict, List, Tuple

from atomic_files import write_atomically
from errors import ConfigError, ExitCode, MissingError

SNAPSHOT_PYTHON = "3.11.7"
SNAPSHOT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_corpus")
SNAPSHOT_PATH = os.path.join(SNAPSHOT_DIR, f"cpython-{SNAPSHOT_PYTHON}-texts.json.xz")
SNAPSHOT_FORMAT = 1


@functools.lru_cache(maxsize=4)
def load(path: str = SNAPSHOT_PATH) -> Dict[str, Tuple[Tuple[str, str], ...]]:
    """The snapshot's ``{"prose": ((topic, text), ...), "code": ((file name, text), ...)}``.

    Cached: the demo corpus asks for it on every ``ensure_demo_corpus`` (~0.3 s to decompress)."""
    try:
        with lzma.open(path, "rt", encoding="utf-8") as f:
            snap = json.load(f)
    except FileNotFoundError:
        raise MissingError(f"demo corpus texts not found: {path} (a checkout without data/demo_corpus/?)") from None
    except (lzma.LZMAError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MissingError(f"demo corpus texts unreadable: {path} ({e})") from None
    if snap.get("format") != SNAPSHOT_FORMAT:
        raise MissingError(f"demo corpus texts {path}: format {snap.get('format')!r}, expected {SNAPSHOT_FORMAT}")
    return {cat: tuple((d["name"], d["text"]) for d in snap[cat]["documents"]) for cat in ("prose", "code")}


def texts_of_this_python() -> Dict[str, List[Dict[str, str]]]:
    """What the running interpreter carries: every pydoc topic and every UTF-8 top-level stdlib file."""
    from pydoc_data.topics import topics

    prose = [{"name": k, "text": topics[k]} for k in sorted(topics)]
    code = []
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
        try:
            with open(path, encoding="utf-8") as f:
                code.append({"name": os.path.basename(path), "text": f.read()})
        except (OSError, UnicodeDecodeError):
            continue  # what the demo always did with such a file: leave it out
    return {"prose": prose, "code": code}


def write(path: str = SNAPSHOT_PATH) -> int:
    """Write this Python's texts to ``path`` (xz, written aside and renamed); returns its size."""
    texts = texts_of_this_python()
    snap = {
        "format": SNAPSHOT_FORMAT,
        "python": platform.python_version(),
        "license": "PSF License Agreement for Python (see NOTICE and LICENSE-PSF.txt beside this file)",
        "prose": {"source": "pydoc_data.topics.topics, every topic in name order", "documents": texts["prose"]},
        "code": {"source": "Lib/*.py, every UTF-8 file in name order", "documents": texts["code"]},
    }

    def compress(tmp):
        # preset 9 | extreme: ~1 MB instead of ~4.9 MB of JSON; decompressing takes ~0.3 s
        with lzma.open(tmp, "wt", encoding="utf-8", preset=9 | lzma.PRESET_EXTREME) as f:
            json.dump(snap, f, ensure_ascii=False)

    write_atomically(path, compress)
    return os.path.getsize(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data.demo_snapshot", description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true",
                    help=f"rewrite {os.path.relpath(SNAPSHOT_PATH)} from this Python (CPython {SNAPSHOT_PYTHON} only)")
    args = ap.parse_args(argv)
    try:
        if not args.write:
            snap = load()
            for cat, docs in snap.items():
                size = sum(len(text.encode("utf-8")) for _, text in docs)
                print(f"{cat}: {len(docs)} documents, {size:,} bytes")
            print(f"{SNAPSHOT_PATH}: {os.path.getsize(SNAPSHOT_PATH):,} bytes (CPython {SNAPSHOT_PYTHON})")
            return ExitCode.OK
        if platform.python_version() != SNAPSHOT_PYTHON:
            # Another Python's texts would change the corpus key and every golden loss.
            raise ConfigError(f"--write on Python {platform.python_version()}: the snapshot is "
                              f"CPython {SNAPSHOT_PYTHON}'s texts; run it there")
        print(f"{SNAPSHOT_PATH}: {write():,} bytes")
        return ExitCode.OK
    except (ConfigError, MissingError) as e:
        print(f"error: {e}", file=sys.stderr)
        return int(e.code)


if __name__ == "__main__":
    sys.exit(main())

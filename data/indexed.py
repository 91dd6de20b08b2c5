"""megatron-core indexed datasets (.bin/.idx): lazy imports, atomic writing, small helpers.

megatron.core takes ~7 s to import (its package __init__ pulls in the whole library) and warns
about missing TE/Apex; everything here imports it lazily, with those warnings silenced, so that
``data.prepare`` workers and ``import data`` stay light.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import re
import socket
import uuid
import warnings
from types import SimpleNamespace
from typing import Dict, Iterator, List, Optional

import numpy as np

_MCORE: Optional[SimpleNamespace] = None


def mcore() -> SimpleNamespace:
    """The megatron-core dataset classes, imported once."""
    global _MCORE
    if _MCORE is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets import indexed_dataset as idx
            from megatron.core.datasets.blended_dataset import BlendedDataset
            from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
            from megatron.core.datasets.utils import Split
        _MCORE = SimpleNamespace(
            IndexedDataset=idx.IndexedDataset,
            IndexedDatasetBuilder=idx.IndexedDatasetBuilder,
            DType=idx.DType,
            GPTDataset=GPTDataset,
            GPTDatasetConfig=GPTDatasetConfig,
            BlendedDataset=BlendedDataset,
            Split=Split,
        )
    return _MCORE


@contextlib.contextmanager
def quiet_megatron_logs() -> Iterator[None]:
    """megatron's dataset classes log every index build at INFO/WARNING ("Unable to save ...
    indexes because path_to_cache is None" for our in-memory epoch indices); hide them."""
    names = [
        "megatron.core.datasets.gpt_dataset",
        "megatron.core.datasets.blended_dataset",
        "megatron.core.datasets.blended_megatron_dataset_builder",
        "megatron.core.datasets.blended_megatron_dataset_config",
        "megatron.core.datasets.indexed_dataset",
        "megatron.core.datasets.megatron_dataset",
    ]
    loggers = [logging.getLogger(n) for n in names]
    old = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, lv in zip(loggers, old):
            lg.setLevel(lv)


def dataset_exists(prefix: str) -> bool:
    """A dataset "looks complete" when both .bin and .idx exist (megatron's own test)."""
    return os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")


def token_dtype(vocab_size: int):
    return mcore().DType.optimal_dtype(vocab_size)


def open_indexed(prefix: str):
    with quiet_megatron_logs():
        return mcore().IndexedDataset(prefix, multimodal=False, mmap=True)


# A temporary's writer: "<pid>@<host>-<random>" inside its name (see writer_tag).
_WRITER = re.compile(r"(?P<pid>\d+)@(?P<host>[^/@]+)-[0-9a-f]{8}")


def writer_tag() -> str:
    """Names this process's temporaries so that a later run can tell whether their writer died."""
    return f"{os.getpid()}@{socket.gethostname()}-{uuid.uuid4().hex[:8]}"


def writer_is_dead(name: str) -> bool:
    """True when `name` carries a writer tag of this host whose process no longer exists.

    Temporaries of another host (a shared file system) or of a live process are left alone.
    """
    m = _WRITER.search(os.path.basename(name))
    if m is None or m["host"] != socket.gethostname():
        return False
    try:
        os.kill(int(m["pid"]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, someone else's
        return False
    return False


def remove_dead_temporaries(pattern: str) -> List[str]:
    """Delete the files/directories matching `pattern` whose writer died; returns their paths."""
    import shutil

    removed = []
    for path in sorted(glob.glob(pattern)):
        if writer_is_dead(path):
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            removed.append(path)
    return removed


def read_sidecar(prefix: str) -> Optional[Dict]:
    try:
        with open(prefix + ".json", encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


class IndexedWriter:
    """Write one indexed dataset through ``IndexedDatasetBuilder`` under a temporary name and
    rename it into place on ``commit()``.

    The .bin is renamed before the .idx (and an old .idx is removed first when overwriting), so at
    every instant either the complete new pair exists or the .idx is missing: an interrupted run
    never leaves something that megatron would take for a complete dataset. Used as a context
    manager, an exception (or KeyboardInterrupt) removes the temporary files; those of a writer
    that was killed (their names carry its pid and host) are removed by the next writer of the
    same prefix.
    """

    def __init__(self, prefix: str, vocab_size: int, overwrite: bool = False):
        self.prefix = prefix
        self.overwrite = overwrite
        d = os.path.dirname(os.path.abspath(prefix))
        os.makedirs(d, exist_ok=True)
        if not overwrite:
            existing = [prefix + e for e in (".bin", ".idx") if os.path.exists(prefix + e)]
            if existing:
                raise FileExistsError(
                    f"output exists: {', '.join(existing)} (pass --overwrite to replace it)"
                )
        # What an earlier writer killed mid-way (SIGKILL, node loss) left behind.
        self.removed_stale = remove_dead_temporaries(glob.escape(prefix) + ".tmp-*")
        self.tmp = f"{prefix}.tmp-{writer_tag()}"
        self.dtype = token_dtype(vocab_size)
        self.builder = mcore().IndexedDatasetBuilder(self.tmp + ".bin", dtype=self.dtype)
        self.documents = 0
        self.tokens = 0
        self._done = False

    def add_document(self, ids: np.ndarray) -> None:
        self.builder.add_document(ids, [len(ids)])
        self.documents += 1
        self.tokens += len(ids)

    def commit(self, sidecar: Optional[Dict] = None) -> None:
        self.builder.finalize(self.tmp + ".idx")
        if sidecar is not None:
            with open(self.tmp + ".json", "w", encoding="utf-8") as f:
                json.dump(sidecar, f, indent=2)
        if os.path.exists(self.prefix + ".idx"):
            os.unlink(self.prefix + ".idx")  # never pair an old .idx with a new .bin
        os.replace(self.tmp + ".bin", self.prefix + ".bin")
        if sidecar is not None:
            os.replace(self.tmp + ".json", self.prefix + ".json")
        os.replace(self.tmp + ".idx", self.prefix + ".idx")  # last: the dataset is now complete
        self._done = True

    def abort(self) -> None:
        if self._done:
            return
        with contextlib.suppress(Exception):
            self.builder.data_file.close()
        for ext in (".bin", ".idx", ".json"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.tmp + ext)
        self._done = True

    def __enter__(self) -> "IndexedWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None or not self._done:
            self.abort()

"""megatron-core indexed datasets (.bin/.idx): lazy imports, atomic writing, small helpers.

megatron.core takes ~7 s to import (its package __init__ pulls in the whole library) and warns
about missing TE/Apex; everything here imports it lazily, with those warnings silenced, so that
``data.prepare`` workers and ``import data`` stay light.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import socket
import warnings
from types import SimpleNamespace
from typing import Dict, Iterator, Optional

import numpy as np

from atomic_files import remove_dead_temporaries, writer_tag
from errors import ConfigError, ExitCode, ProjectError

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
            IndexReader=idx._IndexReader,  # the .idx alone (what IndexedDataset reads it with)
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


def token_dtype(vocab_size: int):
    return mcore().DType.optimal_dtype(vocab_size)


def open_indexed(prefix: str):
    with quiet_megatron_logs():
        return mcore().IndexedDataset(prefix, multimodal=False, mmap=True)


class PrefixInUse(ProjectError):
    """Another process holds an output prefix's lock, or its lock file is one that must not be
    opened (a link, another user's, not a regular file): exit 5."""

    code = ExitCode.IN_USE


class OutputExists(ConfigError):
    """The output is there and may not be replaced (exit 2)."""


LOCK_SUFFIX = ".lock"


class PrefixLock:
    """``PREFIX.lock``: one writer per output prefix, held (``flock``, exclusive) from before the
    output is checked until after it is committed or abandoned.

    The file is opened with ``O_NOFOLLOW`` and must be a regular file of this user with one link,
    so a link planted there never has its target truncated or written. The holder writes its pid,
    host and start time into it, which a refused writer names. It is removed while still held on
    release; a writer that finds the file replaced after taking the lock (its holder removed it)
    takes the new one. A killed holder leaves the file, unlocked: the next writer takes it.
    """

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.path = prefix + LOCK_SUFFIX
        self.fd: Optional[int] = None

    def acquire(self) -> None:
        """Take the lock, or raise PrefixInUse; OSError when the directory cannot be written."""
        import errno
        import fcntl
        import stat
        import time

        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        while True:
            try:
                fd = os.open(self.path, flags, 0o644)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise PrefixInUse(f"{self.path} is a symbolic link: refusing to open it (it "
                                      "would write where it points); remove it") from None
                raise
            try:
                st = os.fstat(fd)
                problem = ("is not a regular file" if not stat.S_ISREG(st.st_mode) else
                           f"belongs to uid {st.st_uid}, not {os.geteuid()}"
                           if st.st_uid != os.geteuid() else
                           f"has {st.st_nlink} hard links (another file shares it)"
                           if st.st_nlink != 1 else None)
                if problem is not None:
                    raise PrefixInUse(f"{self.path} {problem}: refusing to use it as the lock; "
                                      "remove it")
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = os.pread(fd, 400, 0).decode("utf-8", "replace").strip()
                    raise PrefixInUse(f"{self.prefix}: another data.prepare is writing it "
                                      f"({holder or 'holder unknown'}, {self.path}); wait for it "
                                      "or choose another --output") from None
                try:
                    now = os.stat(self.path, follow_symlinks=False)
                except FileNotFoundError:
                    now = None
                if now is None or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                    os.close(fd)  # the previous holder removed it on release: take the new one
                    continue
                os.ftruncate(fd, 0)
                started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
                os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {started}\n"
                          .encode(), 0)
            except BaseException:
                os.close(fd)
                raise
            self.fd = fd
            return

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # still held: no other writer can be between open and flock
        os.close(self.fd)
        self.fd = None


def file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


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
                raise OutputExists(
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

    def commit(self, sidecar: Optional[Dict] = None, before_rename=None) -> None:
        """Finish the files, record their SHA-256 in the sidecar (``checksums``: what
        ``data.prepare --check`` verifies), call ``before_rename()`` (which may raise: nothing
        has been renamed yet, and leaving the context removes the temporaries), then rename
        them into place."""
        self.builder.finalize(self.tmp + ".idx")
        if sidecar is not None:
            sidecar = {**sidecar, "checksums": {"algorithm": "sha256",
                                                "bin": file_sha256(self.tmp + ".bin"),
                                                "idx": file_sha256(self.tmp + ".idx")}}
            with open(self.tmp + ".json", "w", encoding="utf-8") as f:
                json.dump(sidecar, f, indent=2)
        if before_rename is not None:
            before_rename()
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

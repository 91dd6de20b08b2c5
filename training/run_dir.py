"""One trainer per run directory: an exclusive lock on run.dir/.lock for the process's lifetime.

Rank 0 takes the lock (`flock`) before it writes anything else into run.dir and keeps the file
open until the run ends. The kernel drops the lock when the process dies, however it dies
(SIGKILL, the OOM killer; on NFS the server drops it with the client's lease), so a crash never
leaves a stale lock to clean up. The file records the holder (host, pid, Slurm job, start time)
for the message that turns a second trainer away; it is the one file in run.dir that every start
rewrites. While the lock is held no other trainer writes into run.dir, so checkpoint temporaries
found there belong to a dead writer and are removed.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import time
from pathlib import Path

LOCK_NAME = ".lock"
# Errors of a file system without working locks (e.g. Lustre mounted without -o flock).
NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)

_held: dict[Path, int] = {}  # lock path -> open descriptor


class RunDirBusy(Exception):
    """Another process holds run.dir's lock; the message names it."""


def holder() -> dict:
    """Who this process is, as written into the lock file."""
    info = {"host": socket.gethostname(), "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if os.environ.get("SLURM_JOB_ID"):
        info["slurm_job_id"] = os.environ["SLURM_JOB_ID"]
    return info


def describe_holder(text: str) -> str:
    try:
        info = json.loads(text)
        where = f"pid {info['pid']} on host {info['host']}"
    except (ValueError, KeyError, TypeError):
        return "a process that has not recorded itself yet"
    if info.get("slurm_job_id"):
        where += f" (Slurm job {info['slurm_job_id']})"
    return where + f", running since {info.get('started', '?')}"


def lock_run_dir(run_dir: Path) -> bool:
    """Take run.dir's lock for this process (re-entrant); False if the file system has no locks.

    Raises RunDirBusy when another process holds it, OSError when run.dir cannot be written.
    """
    path = (Path(run_dir) / LOCK_NAME).absolute()
    if path in _held:
        return True
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        text = os.pread(fd, 4096, 0).decode(errors="replace")
        os.close(fd)
        raise RunDirBusy(describe_holder(text)) from None
    except OSError as exc:
        os.close(fd)
        if exc.errno in NO_LOCKS:
            return False
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(holder()) + "\n").encode(), 0)
    _held[path] = fd
    return True


def release_run_dir(run_dir: Path) -> None:
    """Give the lock back (the OS does this anyway when the process ends)."""
    fd = _held.pop((Path(run_dir) / LOCK_NAME).absolute(), None)
    if fd is not None:
        os.close(fd)  # closing the only descriptor releases the flock


def remove_stale_checkpoint_temporaries(ckpt_root: Path) -> list[str]:
    """Delete checkpoints/.tmp-* left by a writer that died; call only while holding the lock.

    A temporary never holds a complete checkpoint (those are renamed to step_N), so nothing a
    resume could use is lost.
    """
    if not ckpt_root.is_dir():
        return []
    removed = []
    for tmp in sorted(ckpt_root.glob(".tmp-*")):
        shutil.rmtree(tmp, ignore_errors=True)
        removed.append(tmp.name)
    return removed


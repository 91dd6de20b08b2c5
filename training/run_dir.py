"""One trainer per run directory: an exclusive lock on run.dir/.lock for the process's lifetime.

Rank 0 takes the lock (`flock`) before it writes anything else into run.dir and keeps the file
open until the run ends. The kernel drops the lock when the process dies, however it dies
(SIGKILL, the OOM killer; on NFS the server drops it with the client's lease), so a crash never
leaves a stale lock to clean up. The file records the holder (host, pid, Slurm job, start time)
for the message that turns a second trainer away; it is the one file in run.dir that every start
rewrites. While the lock is held no other trainer writes into run.dir, so checkpoint temporaries
found there belong to a dead writer and are removed.

Every file the run writes into run.dir (.lock, metrics.jsonl, train.log, config.yaml) is opened
through `open_run_file` / `create_run_file`: never through a symbolic link, and only when it is a
regular file of this user with no other name (a hard link), so a link planted in run.dir cannot
turn a write, a truncation or an append on a file elsewhere (UnsafeFile, exit 8).

`prepare_run_dir` is the start of every run: the caller's refusals, then run.dir created, locked
and checked (in use: exit 5; unwritable or a planted link: exit 8; run.resume=never on a run: 5),
stale checkpoint temporaries removed and config.yaml written, rank 0's outcome for every rank.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import stat
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

import torch.distributed as dist

from atomic_files import write_text_atomically
from errors import ExitCode, ProjectError

log = logging.getLogger("nvfp4_pretrain")

LOCK_NAME = ".lock"
# Errors of a file system without working locks (e.g. Lustre mounted without -o flock).
NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)

_held: dict[Path, int] = {}  # lock path -> open descriptor


class RunDirBusy(ProjectError):
    """Another process holds run.dir's lock; the message names it."""

    code = ExitCode.IN_USE


class UnsafeFile(ProjectError):
    """A file the run would write is a link, not a regular file, or another user's."""

    code = ExitCode.UNWRITABLE

    def __init__(self, path, problem: str):
        self.path = Path(path)
        super().__init__(
            f"refusing to write {path}: it {problem}; a file the run writes must be a regular "
            "file of this user with no other name, so that nothing outside run.dir changes: "
            "move it away and run again")


def _link_problem(path) -> str:
    try:
        return f"is a symbolic link (to {os.readlink(path)})"
    except OSError:
        return "is a symbolic link"


def _check_opened(fd: int, path) -> None:
    """Close `fd` and raise UnsafeFile unless it is a regular file of this user, linked once."""
    st = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = "is not a regular file"
    elif st.st_nlink != 1:
        problem = (f"has {st.st_nlink} hard links (writing it would change the file under its "
                   "other names too)")
    elif st.st_uid != os.geteuid():
        problem = f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if problem:
        os.close(fd)
        raise UnsafeFile(path, problem)


def open_run_file(path, flags: int, mode: int = 0o644) -> int:
    """os.open a file in run.dir without following a link (O_NOFOLLOW), and only a regular file
    of this user with no other name: UnsafeFile otherwise. Never pass O_TRUNC (it would act
    before the checks): truncate the returned descriptor instead."""
    assert not flags & os.O_TRUNC, "truncate after the checks"
    try:
        # O_NONBLOCK: a FIFO planted in its place must not block the open
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP and os.path.islink(path):
            raise UnsafeFile(path, _link_problem(path)) from None
        if exc.errno in (errno.ENXIO, errno.EISDIR):  # a FIFO without a reader, a directory
            raise UnsafeFile(path, "is not a regular file") from None
        raise
    _check_opened(fd, path)
    return fd


def create_run_file(path, text: str) -> None:
    """Write a new file into run.dir: O_EXCL, so an existing name (a link, dangling or not,
    included) is never written through (FileExistsError)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def read_run_file(path) -> str:
    """The text of a file in run.dir, refusing a link as open_run_file does."""
    with os.fdopen(open_run_file(path, os.O_RDONLY), "r") as f:
        return f.read()


class OutputRefused(ProjectError):
    """A path the user named for a command's output that the command must not write (exit 2)."""

    code = ExitCode.CONFIG


def check_output_file(output: Path, run_dir: Path, *, overwrite: bool, flag: str = "--output") -> None:
    """The rule for a file a command writes at a path the user names, beside a run it reads:
    never the run directory, inside it or holding it (a typo there would replace the run's own
    checkpoint manifest or metrics); never through a link; an existing file replaced only with
    --overwrite. OutputRefused (exit 2) otherwise, before anything is written."""
    real, run = Path(os.path.realpath(output)), Path(os.path.realpath(run_dir))
    if real == run or run in real.parents or real in run.parents:
        raise OutputRefused(f"{flag}={output}: lies in or over the run directory {run_dir} that "
                            "this command reads; write it outside the run")
    if os.path.islink(output):
        raise OutputRefused(f"{flag}={output}: {_link_problem(output)}; an output is never "
                            "written through a link")
    if os.path.lexists(output):
        if not os.path.isfile(output):
            raise OutputRefused(f"{flag}={output}: exists and is not a regular file")
        if not overwrite:
            raise OutputRefused(f"{flag}={output}: exists; pass --overwrite to replace it")


def write_output_file(output: Path, text: str, *, overwrite: bool) -> None:
    """Write `text` to `output` whole (atomic_files): a link planted at `output` meanwhile is
    replaced, never followed; without `overwrite` a file that appeared there since
    check_output_file is kept (OutputRefused)."""
    try:
        write_text_atomically(output, text, replace=overwrite)
    except FileExistsError:
        raise OutputRefused(f"--output={output}: appeared while this command ran; kept as it "
                            "is (pass --overwrite to replace it)") from None


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

    Raises RunDirBusy when another process holds it, UnsafeFile when .lock is a link (symbolic
    or hard), not a regular file or another user's, OSError when run.dir cannot be written.
    """
    path = (Path(run_dir) / LOCK_NAME).absolute()
    if path in _held:
        return True
    fd = open_run_file(path, os.O_RDWR | os.O_CREAT)  # UnsafeFile: nothing was written
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
    resume could use is lost. A link among them is removed itself, never followed.
    """
    if not ckpt_root.is_dir():
        return []
    removed = []
    for tmp in sorted(ckpt_root.glob(".tmp-*")):
        remove_temporary(tmp)
        removed.append(tmp.name)
    return removed


def remove_temporary(path: Path) -> None:
    """Delete a temporary directory of ours; a link (or file) in its place goes, unfollowed."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:  # rmtree never follows a link inside the tree (it works on directory descriptors)
        shutil.rmtree(path, ignore_errors=True)



# -- preparing a run directory -----------------------------------------------------------------


def holds_a_run(run_dir: Path) -> bool:
    return (run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists()


def unwritable_message(key: str, directory, exc: OSError) -> str:
    where = f" ({exc.filename})" if exc.filename else ""
    return (f"{key}={directory} cannot be written: {exc.strerror or exc}{where}; it must be a "
            "writable directory (or a path where one can be created)")


def unwritable_key(exc: OSError, directories) -> Optional[tuple[str, str]]:
    """(key, directory) of the `(key, directory)` pairs that an OSError concerns, else None."""
    if not exc.filename:
        return None
    path = os.path.abspath(os.fsdecode(exc.filename))
    for key, directory in directories:
        root = os.path.abspath(str(directory))
        if path == root or path.startswith(root + os.sep):
            return key, str(directory)
    return None


def prepare_run_dir(run_dir: Path, is_main: bool, *, resume: str, config_text: str,
                    refusals: Callable[[], None]) -> Path:
    """Rank 0 checks, locks run.dir and writes config.yaml once; every rank gets the outcome.

    Nothing is written before the checks that can refuse the run: `refusals()` (the caller's,
    raising a ProjectError) and run.resume=never on a run; then run.dir/.lock is taken before
    anything else is written, and a second trainer on the same run.dir is turned away.
    """
    refusal = None
    if is_main:
        try:
            refusals()
            _prepare_on_main(run_dir, resume, config_text)
        except ProjectError as exc:
            refusal = (str(exc), exc.code)
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [refusal]
        dist.broadcast_object_list(box, src=0)  # every rank stops with rank 0's code
        refusal = box[0]
    if refusal is not None:
        raise ProjectError(*refusal)
    return run_dir


def _prepare_on_main(run_dir: Path, resume: str, config_text: str) -> None:
    never = (f"run.dir={run_dir} already holds a run and run.resume=never; choose another "
             "run.dir or set run.resume=auto to continue it")
    if resume == "never" and holds_a_run(run_dir):
        raise ProjectError(never, ExitCode.IN_USE)
    try:
        with _writing_into(run_dir):
            run_dir.mkdir(parents=True, exist_ok=True)
            locked = lock_run_dir(run_dir)
    except RunDirBusy as exc:
        raise RunDirBusy(
            f"run.dir={run_dir} is in use by another trainer: {exc}; wait for it to end or stop "
            "it (its lock goes with the process), or choose another run.dir") from None
    if not locked:
        log.warning(f"run.dir={run_dir}: the file system does not support locks; nothing "
                    "stops a second trainer from writing into this run directory")
    if resume == "never" and holds_a_run(run_dir):  # a run that ended meanwhile
        raise ProjectError(never, ExitCode.IN_USE)
    if locked:  # no other writer: a temporary checkpoint here belongs to a dead one
        for name in remove_stale_checkpoint_temporaries(run_dir / "checkpoints"):
            log.warning(f"removed {run_dir / 'checkpoints' / name}: an unfinished checkpoint "
                        "of a process that died")
    config_path = run_dir / "config.yaml"
    with _writing_into(run_dir):  # created, never written through an existing name (a link)
        if not os.path.lexists(config_path):
            create_run_file(config_path, config_text)
        elif read_run_file(config_path) != config_text:  # a resume with another config: keep both
            n = 1
            while os.path.lexists(run_dir / f"config.resume-{n}.yaml"):
                n += 1
            create_run_file(run_dir / f"config.resume-{n}.yaml", config_text)


@contextmanager
def _writing_into(run_dir: Path):
    """A planted link (UnsafeFile) or the file system's refusal, as one line naming run.dir
    (exit 8)."""
    try:
        yield
    except UnsafeFile as exc:
        raise ProjectError(f"run.dir={run_dir}: {exc}", exc.code) from None
    except OSError as exc:
        raise ProjectError(unwritable_message("run.dir", run_dir, exc),
                           ExitCode.UNWRITABLE) from None

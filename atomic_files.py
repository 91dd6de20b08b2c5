"""Files written whole or not at all, and the temporaries of writers that died.

Every writer of the project stages its output under a temporary name beside the final one and
renames it into place, so a reader never sees half a file. The temporary's name carries a writer
tag, `<pid>@<host>-<random>`: a later writer on the same host removes the temporaries whose
process no longer exists (SIGKILL, a node's OOM killer), and leaves alone those of a live
process or of another host sharing the file system, which it cannot judge.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import socket
import uuid
from pathlib import Path
from typing import Callable, List

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
    removed = []
    for path in sorted(glob.glob(pattern)):
        if writer_is_dead(path):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            removed.append(path)
    return removed


def temporary_pattern(path: Path, kind: str = "tmp") -> str:
    """The glob of every writer's temporaries of `path` (escaped: the name may hold `[`)."""
    return str(Path(glob.escape(str(path.parent))) / f".{glob.escape(path.name)}.{kind}-*")


def temporary_for(path: Path, kind: str = "tmp") -> Path:
    """A fresh temporary name of this process for `path`, beside it (one file system: the
    rename into place is atomic)."""
    return path.with_name(f".{path.name}.{kind}-{writer_tag()}")


def write_atomically(path, write: Callable[[Path], None], *, replace: bool = True,
                     mode: int = 0o644) -> None:
    """`write(temporary)` then one rename onto `path`: a reader sees the old file or the new
    one, never a part. The dead writers' temporaries of `path` go first. A link at `path` is
    replaced, never followed. Without `replace` the temporary is linked into place, so a file
    that is already there is kept (FileExistsError)."""
    path = Path(path)
    remove_dead_temporaries(temporary_pattern(path))
    tmp = temporary_for(path)
    try:
        write(tmp)
        os.chmod(tmp, mode)  # mkstemp-style writers make 0600 files
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def write_text_atomically(path, text: str, *, replace: bool = True) -> None:
    """write_atomically for a text (UTF-8)."""
    write_atomically(path, lambda tmp: tmp.write_text(text, encoding="utf-8"), replace=replace)

"""Whole-or-nothing writes, and every writer removing what a killed writer left (atomic_files.py):
the plan, the tokenizer, evaluate's --output, the Hugging Face export."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from atomic_files import write_atomically, write_text_atomically, writer_is_dead

HOST = socket.gethostname()


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # exited and reaped: nothing runs under this pid now
    return proc.pid


def plant(path: Path, kind: str = "tmp") -> dict[str, Path]:
    """A killed writer's temporary of `path`, a live writer's and another host's (whose liveness
    this host cannot judge)."""
    names = {"dead": f"{dead_pid()}@{HOST}-0123abcd", "live": f"{os.getpid()}@{HOST}-4567cdef",
             "other host": f"{dead_pid()}@not-{HOST}-89abcdef"}
    planted = {}
    for who, tag in names.items():
        planted[who] = path.with_name(f".{path.name}.{kind}-{tag}")
        planted[who].write_text(who)
    return planted


def test_a_write_replaces_whole_and_removes_only_a_dead_writers_temporaries(tmp_path):
    target = tmp_path / "plan.json"
    target.write_text("old")
    planted = plant(target)
    assert writer_is_dead(planted["dead"].name) and not writer_is_dead(planted["live"].name)
    write_text_atomically(target, "new")
    assert target.read_text() == "new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert not planted["dead"].exists()
    assert planted["live"].exists() and planted["other host"].exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [target.name, planted["live"].name, planted["other host"].name])


def test_without_replace_an_existing_file_is_kept_and_a_failed_write_leaves_nothing(tmp_path):
    target = tmp_path / "results.json"
    target.write_text("theirs")
    with pytest.raises(FileExistsError):
        write_text_atomically(target, "ours", replace=False)
    assert target.read_text() == "theirs"

    def fails(tmp):
        tmp.write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        write_atomically(target, fails)
    assert target.read_text() == "theirs" and [p.name for p in tmp_path.iterdir()] == [target.name]


def test_a_link_at_the_target_is_replaced_never_followed(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    link = tmp_path / "out.json"
    link.symlink_to(outside)
    write_text_atomically(link, "new")
    assert outside.read_text() == "precious" and not link.is_symlink()
    assert link.read_text() == "new"


def _write_plan(tmp_path):
    from training.plan import write_plan

    return write_plan({"a": 1}, tmp_path)


def _save_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models

    from data.tokenizer import save_tokenizer_atomic

    path = tmp_path / "tokenizer.json"
    save_tokenizer_atomic(Tokenizer(models.BPE()), str(path))
    return path


def _write_output(tmp_path):
    from training.run_dir import write_output_file

    path = tmp_path / "results.json"
    write_output_file(path, "{}", overwrite=True)
    return path


@pytest.mark.parametrize("writer", [_write_plan, _save_tokenizer, _write_output],
                         ids=["plan.json", "tokenizer.json", "evaluate --output"])
def test_each_writer_removes_a_killed_writers_temporaries(tmp_path, writer):
    name = {"_write_plan": "plan.json", "_save_tokenizer": "tokenizer.json",
            "_write_output": "results.json"}[writer.__name__]
    planted = plant(tmp_path / name)
    written = writer(tmp_path)
    assert written.is_file() and written.name == name
    assert not planted["dead"].exists() and planted["live"].exists()
    assert len(list(tmp_path.iterdir())) == 3  # the file, the live and the other host's


def test_an_export_killed_mid_way_leaves_nothing_and_a_moved_previous_export_comes_back(tmp_path):
    """write_hf_dir's start: a dead export's unfinished copy is removed; a previous export it
    had moved aside (killed between its two renames) goes back under its name if that is free,
    and is removed if a newer export holds the name."""
    from model.hf import _recover_dead_exports

    output = tmp_path / "hf"
    copy, old = (output.with_name(f".hf.{kind}-{dead_pid()}@{HOST}-0123abcd")
                 for kind in ("tmp", "old"))
    for directory in (copy, old):
        directory.mkdir()
        (directory / "model.safetensors").write_text(directory.name)
    _recover_dead_exports(output)
    assert not copy.exists() and not old.exists()
    assert (output / "model.safetensors").read_text() == old.name  # the previous export is back
    old.mkdir()
    _recover_dead_exports(output)  # the name is taken now: the moved-aside copy just goes
    assert not old.exists() and (output / "model.safetensors").read_text() == old.name

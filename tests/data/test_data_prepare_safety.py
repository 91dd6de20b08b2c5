"""data.prepare never replaces what another run wrote, `--check` catches a flipped byte, and the
faults of reading and writing are one `error:` line with a documented exit code."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from data.prepare import cli
from errors import ExitCode
from tests.helpers import unwritable_output
from tests.prepare_helpers import (OTHER, TEXTS, args, decoded, hook_first_batch, jsonl,
                                   one_error_line)


def files_under(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# -- two data.prepare runs on one output prefix ------------------------------------------------


@pytest.mark.parametrize("overwrite", [False, True])
def test_an_output_that_appears_before_the_commit_is_never_replaced(
        tmp_path, tiny_tokenizer, monkeypatch, capsys, overwrite):
    """The earlier run commits after another writer (one that took no lock: an older version, a
    copy) put a dataset at the prefix: refused at the commit, that dataset left byte for byte;
    --overwrite replaces it, as asked."""
    out = tmp_path / "o" / "web"
    other = tmp_path / "other" / "web"
    assert cli.main(args([jsonl(tmp_path / "b.jsonl", OTHER)], tiny_tokenizer, other)) == 0
    capsys.readouterr()

    def land():  # what a finished writer's commit does: renames into place
        for ext in (".bin", ".json", ".idx"):
            os.replace(f"{other}{ext}", f"{out}{ext}")

    hook_first_batch(monkeypatch, land)
    rc = cli.main(args([jsonl(tmp_path / "a.jsonl", TEXTS)], tiny_tokenizer, out,
                       "--batch-bytes", "200", *(["--overwrite"] if overwrite else [])))
    names = sorted(p.name for p in out.parent.iterdir())
    assert names == ["web.bin", "web.idx", "web.json"]  # no temporaries, no lock file
    if overwrite:
        assert rc == 0 and decoded(out, tiny_tokenizer) == TEXTS
    else:
        assert rc == 2
        assert f"refusing to overwrite {out}" in one_error_line(capsys.readouterr().err)
        assert decoded(out, tiny_tokenizer) == OTHER


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_a_lock_file_that_is_a_link_is_refused_and_its_target_untouched(
        tmp_path, tiny_tokenizer, capsys, link):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "o" / "web"
    out.parent.mkdir()
    (os.symlink if link == "symlink" else os.link)(victim, f"{out}.lock")
    assert cli.main(args([jsonl(tmp_path / "a.jsonl", TEXTS)], tiny_tokenizer, out)) == \
        ExitCode.IN_USE
    assert f"{out}.lock" in one_error_line(capsys.readouterr().err)
    assert victim.read_text() == "precious"
    assert sorted(p.name for p in out.parent.iterdir()) == ["web.lock"]


# -- --check verifies the bytes -----------------------------------------------------------------


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


IDX_LENGTHS = 34  # megatron's .idx: 9-byte magic, version, dtype code, two counts, then lengths


@pytest.mark.parametrize("where", ["bin", "idx_lengths", "idx_pointers"])
def test_check_catches_one_flipped_byte(tmp_path, tiny_tokenizer, capsys, where):
    corpus = jsonl(tmp_path / "a.jsonl", TEXTS)
    web, code = tmp_path / "web", tmp_path / "code_shard0"
    assert cli.main(args([corpus], tiny_tokenizer, web)) == 0
    assert cli.main(args([corpus], tiny_tokenizer, tmp_path / "code", "--shard", "0/1")) == 0
    capsys.readouterr()
    assert cli.main(["--check", str(web), str(tmp_path / "code")]) == 0
    capsys.readouterr()
    for prefix in (web, code):
        n = json.loads(Path(f"{prefix}.json").read_text())["documents"]
        if where == "bin":
            flip(f"{prefix}.bin", os.path.getsize(f"{prefix}.bin") // 2)
        else:
            flip(f"{prefix}.idx", IDX_LENGTHS + (4 * n if where == "idx_pointers" else 0) + 1)
    assert cli.main(["--check", str(web), str(tmp_path / "code")]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2, err
    for prefix in (web, code):
        line = next(x for x in err if x.startswith(f"error: {prefix}: "))
        if where == "bin":
            assert "its .bin does not match its sha256" in line
        elif where == "idx_lengths":
            assert "its .idx lengths add up to" in line
        else:
            assert "its .idx pointers" in line
        assert json.loads(Path(f"{prefix}.json").read_text())["checksums"]["algorithm"] == "sha256"


def test_check_without_recorded_checksums_says_so_and_still_checks_the_lengths(
        tmp_path, tiny_tokenizer, capsys):
    web = tmp_path / "web"
    assert cli.main(args([jsonl(tmp_path / "a.jsonl", TEXTS)], tiny_tokenizer, web)) == 0
    sidecar = Path(f"{web}.json")
    meta = json.loads(sidecar.read_text())
    meta.pop("checksums", None)  # a dataset made before checksums were recorded
    sidecar.write_text(json.dumps(meta))
    capsys.readouterr()
    assert cli.main(["--check", str(web)]) == 0
    captured = capsys.readouterr()
    assert f"warning: {web}: no checksum recorded" in captured.err
    assert "1 dataset(s) without checksums" in captured.out
    flip(f"{web}.idx", IDX_LENGTHS + 1)
    assert cli.main(["--check", str(web)]) == 3
    assert "its .idx lengths add up to" in capsys.readouterr().err


# -- one line, documented exit code -------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncated", "corrupt"])
def test_a_damaged_gzip_input_is_one_line_naming_the_file_and_the_offset(
        tmp_path, tiny_tokenizer, capsys, damage):
    gz = tmp_path / "in.jsonl.gz"
    with gzip.open(gz, "wb") as f:
        f.write(b"".join(json.dumps({"text": t * 20}).encode() + b"\n" for t in TEXTS))
    data = gz.read_bytes()
    if damage == "truncated":
        gz.write_bytes(data[: len(data) // 2])
    else:  # one flipped byte in the last 4 bytes' size field: the stream ends in a bad trailer
        gz.write_bytes(data[:-1] + bytes([data[-1] ^ 0x01]))
    out = tmp_path / "o" / "web"
    assert cli.main(args([gz], tiny_tokenizer, out)) == ExitCode.BAD_INPUT
    line = one_error_line(capsys.readouterr().err)
    assert f"{gz}: " in line and "byte" in line and "no output written" in line
    assert not out.parent.exists() or not list(out.parent.iterdir())


@pytest.mark.parametrize("where", ["sysfs", "under_a_file"])
def test_an_output_that_cannot_be_written_is_one_line_and_exit_8(tmp_path, tiny_tokenizer,
                                                                 capsys, where):
    out = unwritable_output(where, tmp_path, "nvfp4-data") / "web"
    corpus = jsonl(tmp_path / "a.jsonl", TEXTS)
    before = files_under(tmp_path)
    assert cli.main(args([corpus], tiny_tokenizer, out)) == ExitCode.UNWRITABLE
    assert f"--output {out} cannot be written" in one_error_line(capsys.readouterr().err)
    assert files_under(tmp_path) == before


def test_a_full_disk_mid_run_is_one_line_and_leaves_nothing(tmp_path, tiny_tokenizer, capsys,
                                                           monkeypatch):
    import errno

    from data.indexed import IndexedWriter

    def full(self, ids):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(IndexedWriter, "add_document", full)
    out = tmp_path / "o" / "web"
    assert cli.main(args([jsonl(tmp_path / "a.jsonl", TEXTS)], tiny_tokenizer, out)) == \
        ExitCode.UNWRITABLE
    assert "No space left on device" in one_error_line(capsys.readouterr().err)
    assert not list(out.parent.iterdir())


def test_sigterm_while_tokenizing_exits_143_and_leaves_nothing(tmp_path, tiny_tokenizer,
                                                               monkeypatch, capsys):
    """Slurm's scancel (SIGTERM) mid-run: one line, ExitCode.TERMINATED, no output and no
    temporaries (the handler unwinds through the writer's clean-up)."""
    import signal

    out = tmp_path / "o" / "web"
    hook_first_batch(monkeypatch, lambda: os.kill(os.getpid(), signal.SIGTERM))
    rc = cli.main(args([jsonl(tmp_path / "a.jsonl", TEXTS)], tiny_tokenizer, out,
                       "--batch-bytes", "200"))
    assert rc == ExitCode.TERMINATED == 143
    assert "terminated (SIGTERM): no output written" in one_error_line(capsys.readouterr().err)
    assert not out.parent.exists() or not list(out.parent.iterdir())
    assert signal.getsignal(signal.SIGTERM) is not cli._on_sigterm  # the handler was restored
